"""Adaptive averaging planner: who aggregates which share of the gradient vector (DeDLOC, section 3.2).

Pure Python over numpy and scipy: no torch, no hivemind. Bandwidths are bytes per second, sizes bytes, times
seconds. ``plan_averaging`` solves the LP of one averaging round; ``plan_step`` that of the whole optimizer step,
in groups; the ``*_seconds`` functions model the strategies it is compared with;
``Replanner`` decides when a new plan is worth publishing; ``fit_round_costs`` fits what rounds cost beyond
bandwidth from the rounds a swarm measured.
"""

from app.planner.fit import RoundObservation, fit_round_costs
from app.planner.hysteresis import Replanner
from app.planner.lp import (
    HOLD_BACK_FLOOR,
    byteps_seconds,
    equal_split_seconds,
    hivemind_shares,
    hivemind_split_seconds,
    lower_bound_seconds,
    parameter_server_seconds,
    plan_averaging,
    ring_allreduce_seconds,
    round_seconds,
)
from app.planner.model import BANDWIDTH_ONLY, ROLES, PeerProfile, Plan, PlanningError, RoundCosts
from app.planner.step import StepOptions, partition_groups, plan_cost, plan_round_seconds, plan_step

__all__ = [
    "BANDWIDTH_ONLY",
    "HOLD_BACK_FLOOR",
    "PeerProfile",
    "Plan",
    "PlanningError",
    "ROLES",
    "Replanner",
    "RoundCosts",
    "RoundObservation",
    "StepOptions",
    "byteps_seconds",
    "equal_split_seconds",
    "fit_round_costs",
    "hivemind_shares",
    "hivemind_split_seconds",
    "lower_bound_seconds",
    "parameter_server_seconds",
    "partition_groups",
    "plan_averaging",
    "plan_cost",
    "plan_round_seconds",
    "plan_step",
    "ring_allreduce_seconds",
    "round_seconds",
]
