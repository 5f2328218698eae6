"""The demo's log line for a gate decision says what training did next."""

from clawloop.sim.demo import gate_line


def test_a_rejection_says_whether_training_went_back_or_on():
    base = {"kind": "gate_rejected", "steps": [3, 4], "reasons": ["2 of 17 known facts forgotten"], "guard_pass": 1.0,
            "kl": 0.2, "seconds": 40}
    restored = gate_line({**base, "restored_version": 1})
    assert "steps 3-4: REJECTED (2 of 17 known facts forgotten)" in restored and "training back to v1" in restored
    kept = gate_line({**base, "restored_version": None})
    assert "training goes on from it" in kept and "back to" not in kept
    accepted = gate_line({"kind": "gate_accepted", "steps": [5], "version": 2, "guard_pass": 1.0, "kl": 0.1})
    assert accepted.startswith("[gate] step 5: accepted, serving v2")


def test_a_check_decided_on_the_facts_alone_claims_no_guard_or_kl():
    line = gate_line({"kind": "gate_rejected", "steps": [1, 2], "reasons": ["facts stated in 80 of the sampled "
                      "answers, the reference's in 99: more than 10% fewer"], "guard_pass": 1.0, "kl": 0.0,
                      "kl_measured": False, "seconds": 23, "restored_version": 0})
    assert "decided on the knowledge probes alone, 23s" in line and "guard" not in line and "KL" not in line
