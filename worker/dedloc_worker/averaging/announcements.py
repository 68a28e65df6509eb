"""What each member of an averaging group announces about the plan it follows, and how the group checks it.

Every member announces, with its matchmaking metadata, the share of the vector it says it aggregates and the signed
plan that gives it that share (``announce``). Once the group has formed, every member holds every announcement, and
``split_group`` turns them into the split, the same on every honest member because it reads nothing else:

1. A member is **left out** when what it announced does not hold up: no marker of this version, a plan the run's
   authority did not sign, or a share other than the one its own announced plan gives it (to the plan's signed
   precision, 1e-9; a member without a plan must announce no share). Its fraction is 0, and the aggregators refuse
   its parts (``averaging.planned.PlannedAverager``), as hivemind refuses a banned sender's.
2. The group's plan is the newest authentic plan any member announced: a member still on an older plan announced
   that plan's share honestly, and follows the newer one here without having read it.
3. Members that may aggregate (not client-mode, not left out) and that the group's plan does not name get an equal
   fraction each, 1/k of k such members; the members it names share the rest in proportion to their planned shares.
   Without a plan, or with a plan that gives the members it names nothing, every such member gets 1/k.

Design and what stays undefended: docs/averaging.md#checked-shares.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dedloc_common.contract import PlanRecord, plan_payload, pydantic_v1
from dedloc_common.signing import verify
from hivemind.averaging.allreduce import AveragingMode

PLAN_MARKER = "dedloc.plan/3"
"""First item of the metadata a ``PlannedAverager`` announces; peers without it are not ``PlannedAverager``s.
Version 2: in a planned group, results stream to zero-share peers while they upload (``StreamingAllReduceRunner``).
Version 3: each member announces the signed plan its share comes from, and the group checks it (``split_group``);
a member of another version counts as foreign and is left out where the run's authority checks plans."""

SHARE_PRECISION = 1e-9
"""How far an announced share may be from its plan's: the plan's signature covers shares rounded to 1e-9
(``contract.plan_payload``). An honest member announces the plan's own number."""
REASON_CHARS = 200  # a left-out member's reason, as attested, at most


@dataclass(frozen=True)
class Announcement:
    """What one member announced: its share (a fraction of the vector, or None) and its plan (``PlanRecord.dict()``,
    or None), both as received: unchecked."""

    share: Any
    plan: Any


def announce(share: Optional[float], plan: Optional[PlanRecord], gather: Any) -> list:
    """The metadata a member sends in place of the caller's ``gather``."""
    return [PLAN_MARKER, share, None if plan is None else plan.dict(), gather]


def unwrap(gathered: Sequence[Any]) -> Tuple[List[Optional[Announcement]], List[Any]]:
    """Each member's (announcement, None for a member without this version's marker) and the caller's own gather."""
    ours = [isinstance(item, (list, tuple)) and len(item) == 4 and item[0] == PLAN_MARKER for item in gathered]
    announcements = [Announcement(item[1], item[2]) if mine else None for item, mine in zip(gathered, ours)]
    return announcements, [item[3] if mine else item for item, mine in zip(gathered, ours)]


class PlanCheck:
    """Whether a plan is signed by the run's authority, remembering the last few plans it checked.

    :param authority: the run's authority key (``admission.gate.TokenCheck.authority``)
    """

    REMEMBERED = 16

    def __init__(self, authority) -> None:
        self.authority = authority
        self._seen: "OrderedDict[str, bool]" = OrderedDict()

    def authentic(self, plan: PlanRecord) -> bool:
        payload = plan_payload(plan.shares, plan.predicted_seconds, plan.issued_at, plan.groups)
        key = hashlib.sha256(payload).hexdigest() + plan.signature
        if key not in self._seen:
            self._seen[key] = verify(self.authority, payload, plan.signature)
            while len(self._seen) > self.REMEMBERED:
                self._seen.popitem(last=False)
        return self._seen[key]


@dataclass
class GroupSplit:
    """What ``split_group`` made of a group's announcements.

    :param fractions: the fraction of the vector each member aggregates, in the group's order, summing to one
    :param plan: the group's plan (the newest authentic one announced), or None
    :param left_out: PeerID -> why that member is left out of the round, in words
    """

    fractions: Tuple[float, ...]
    plan: Optional[PlanRecord] = None
    left_out: Dict[str, str] = field(default_factory=dict)


def split_group(peer_ids: Sequence[str], modes: Sequence[AveragingMode],
                announcements: Sequence[Optional[Announcement]], check: PlanCheck) -> GroupSplit:
    """The split every honest member of the group computes alike (see the module doc).

    :param peer_ids: the members (base58 PeerIDs), in the group's order
    :param modes: each member's averaging mode, as it announced it; client-mode members get 0
    :param announcements: each member's (``unwrap``), None for a member without this version's marker
    :raises ValueError: when no member is left that may aggregate
    """
    plans, left_out = [], {}
    for peer, said in zip(peer_ids, announcements):
        plan, fault = _checked(peer, said, check)
        if plan is not None:
            plans.append(plan)
        if fault:
            left_out[peer] = fault[:REASON_CHARS]
    newest = max(plans, key=lambda plan: (plan.issued_at, plan.signature), default=None)
    may = [mode != AveragingMode.CLIENT and peer not in left_out for peer, mode in zip(peer_ids, modes)]
    if not any(may):
        raise ValueError("no member of the group is left that may aggregate")
    return GroupSplit(_fractions(peer_ids, may, newest), newest, left_out)


def _checked(peer: str, said: Optional[Announcement], check: PlanCheck) -> Tuple[Optional[PlanRecord], str]:
    """(the member's plan if authentic, why the member is left out or "")."""
    if said is None:
        return None, f"announced no {PLAN_MARKER} marker: not a planned averager of this version"
    plan = None
    if said.plan is not None:
        try:
            plan = PlanRecord.parse_obj(said.plan)
        except (pydantic_v1.ValidationError, TypeError):
            return None, "announced a malformed plan"
        if not check.authentic(plan):
            return None, "announced a plan the run's authority did not sign"
    share = said.share
    if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool)
                                  and math.isfinite(share) and share >= 0):
        return plan, f"announced share {share!r}, not a fraction"
    planned = None if plan is None else plan.shares.get(peer)
    if planned is None:
        if share is None:
            return plan, ""
        where = "without a plan" if plan is None else f"that its plan of {plan.issued_at!r} does not give it"
        return plan, f"announced share {share!r} {where}"
    if share is None or abs(float(share) - planned) > SHARE_PRECISION:
        return plan, f"announced share {share!r} where its plan of {plan.issued_at!r} gives it {planned!r}"
    return plan, ""


def _fractions(peer_ids: Sequence[str], may: Sequence[bool], plan: Optional[PlanRecord]) -> Tuple[float, ...]:
    count = sum(may)
    named = [can and plan is not None and peer in plan.shares for peer, can in zip(peer_ids, may)]
    named_total = sum(plan.shares[peer] for peer, is_named in zip(peer_ids, named) if is_named)
    if named_total <= 0:
        return tuple(1.0 / count if can else 0.0 for can in may)
    rest = 1.0 - (count - sum(named)) / count  # what the members the plan does not name leave
    return tuple(rest * plan.shares[peer] / named_total if is_named else 1.0 / count if can else 0.0
                 for peer, can, is_named in zip(peer_ids, may, named))


def trusted_shares(announcements: Sequence[Optional[Announcement]]) -> List[Optional[float]]:
    """Each member's share as announced, unchecked (an averager without the run's authority: the benches, which plan
    by hand); all None where a member is foreign, so that the group runs hivemind's own split, as that member does."""
    if any(said is None for said in announcements):
        return [None] * len(announcements)
    return [float(said.share) if isinstance(said.share, (int, float)) and not isinstance(said.share, bool)
            and math.isfinite(said.share) and said.share >= 0 else None for said in announcements]
