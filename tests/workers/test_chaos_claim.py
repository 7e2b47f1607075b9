"""A once-per-job chaos fault is claimed in Ray's KV store (a real local Ray): the first claimer wins,
another loses, and a claimer whose put landed but whose reply was lost (so it puts again) still holds
its own claim and fires."""

from __future__ import annotations

from workers.chaos import Fault, claim_once, forget_claims


def test_first_claimer_wins_and_a_retried_put_keeps_its_claim(local_ray: None) -> None:
    fault = Fault("kill_worker", 30, rank=1, generation=None, index=3)
    assert claim_once("claim-job", fault, token="rank 1 of generation 2")
    assert not claim_once("claim-job", fault, token="rank 1 of generation 3")
    assert not claim_once("claim-job", fault)  # a default token is unique: another process
    # The same claimer again: its first put stored the value, the reply was lost, the put was retried.
    assert claim_once("claim-job", fault, token="rank 1 of generation 2")
    # Another fault of the same job, and the same fault of another job, are claims of their own.
    assert claim_once("claim-job", Fault("hang_worker", 40, generation=None, index=4))
    assert claim_once("other-job", fault)
    assert forget_claims("claim-job") == 2
    assert claim_once("claim-job", fault)
