"""``ringtrain chaos``: verify that a training resumes exactly under failures.

A campaign runs the user's train function once without faults, then several times under
seeded-random faults (workers SIGKILLed at random moments and mid-checkpoint-write, workers
SIGSTOPped, the driver SIGKILLed and the run resumed), and compares every checkpoint of each faulty
run with the clean run's, bit for bit. See docs/chaos.md.

    from ringtrain.chaos import run_campaign
    report = run_campaign(train_fn, steps=24, runs=3, workers=(2, 3))
    assert report.ok
"""

from __future__ import annotations

from ringtrain.chaos.campaign import CampaignReport, ChaosError, RunReport, run_campaign
from ringtrain.chaos.plan import FAULT_KINDS, VERDICTS, ChaosConfig, Fault, make_plan

__all__ = [
    "FAULT_KINDS",
    "VERDICTS",
    "CampaignReport",
    "ChaosConfig",
    "ChaosError",
    "Fault",
    "RunReport",
    "make_plan",
    "run_campaign",
]
