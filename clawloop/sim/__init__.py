"""Simulated users that talk to a clawloop server over HTTP, and the preference score that shows learning.

* ``personas``: users with a hidden preference, their question pools and their replies;
* ``checkers``: deterministic tests of each preference (language by stop words, length, fixed opening);
* ``guard``: the degeneracy guard (loops, junk, off-topic answers) that every scored answer must also pass;
* ``user``: who writes the user's messages (scripted phrasings, or an LLM over an OpenAI-compatible API);
* ``driver``: training sessions against a server and the held-out evaluation (side turns, greedy);
* ``persona_file``: a persona defined in a TOML or JSON file;
* ``sessions``: what the user received per session, sessions to a stable effect, sessions per version;
* ``trained_terms``: which loss terms trained, from the step metrics;
* ``probe``: a manual check of which preferences a model can follow when told.
"""
