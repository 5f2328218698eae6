"""The publication gate: a candidate version is checked on a probe set before anyone is served by it.

* ``guard`` — the degeneracy guard (is an answer still a sound piece of text?);
* ``probes`` — the general prompts shipped with clawloop that every candidate answers;
* ``knowledge`` — questions with known answers; a candidate must keep the facts the reference knew;
* ``generation`` — batched answers to the probes, greedy or sampled, with the candidate's log-probabilities;
* ``scoring`` — given answers scored under the reference (the KL, the preference reading), its prompts' states kept;
* ``preference`` — the hint's implicit reward, by which a candidate that unlearnt the preference is told apart;
* ``gate`` — the decision (greedy probe answers, guard regressions, KL to the reference), with its evidence.

Design notes: docs/publication-gate.md.
"""
