"""Calibrations the policy tests share."""

from pkv.policy import Calibration

# The paper's RTX 3060 constants (section 3.5) in the flat form of the first calibration files:
# the defaults of that form give every regime its paper value.
PAPER = Calibration.from_mapping({"gpu": "rtx3060", "num_sms": 28, "beta_gbps": 331.2, "lambda_us": 8.19,
                                  "c_min": 4.0}, "paper")
SHAPE = dict(num_kv_heads=8, group_size=4, head_dim=128)
