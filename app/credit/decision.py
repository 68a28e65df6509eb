"""The crediting decision for one claim, as a pure function of the claim, what other users' peers in its round saw,
and the time the coordinator observed (``decide``), with the reasons in words volunteers and organizers read.
The rules are described in ``app.credit.settlement``; this module has no database access, so property tests can
drive it directly."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from app.models import Contribution, max_length

REASON_LENGTH = max_length(Contribution, "reason")
NOT_ACCUSED = "this is not an accusation"
NO_TOKEN = "no peer token was issued for this key: the swarm cannot tell whose it is"
NO_ROUND = ("not confirmed: no averaging round formed in this epoch, so no other volunteer saw these samples "
            f"(rounds fail when peers are slow or leave; {NOT_ACCUSED})")
ALONE = ("not confirmed: the averaging round did not form with anyone else, no other volunteer averaged with this "
         f"peer, so nobody could confirm these samples ({NOT_ACCUSED})")
WEIGHTLESS = ("not confirmed: its round's other volunteers saw it join with weight 0, as a peer catching up with the "
              f"swarm or leaving joins a round, so these samples entered no shared step ({NOT_ACCUSED})")
# the aggregators' account of the lost parts follows it, with NOT_ACCUSED (settlement's shortfall words)
LOST = "not confirmed in full: {seen:,} of its {claimed:,} samples reached the peers that averaged with it"
NO_MEMBERS = ("not confirmed: this worker did not list its round's members (a dedloc-worker older than the "
              "portal's): update it")
# Dispute kinds, against the receipt's author.
OUTVOTED, NOT_A_MEMBER, UNRESOLVED = "outvoted", "not a member", "unresolved"


def unfinished(others: int) -> str:
    """A round with other volunteers listed, none of whose peers confirmed this one's part."""
    volunteers = "another volunteer" if others == 1 else f"{others} other volunteers"
    return (f"not confirmed: the averaging round with {volunteers} did not finish, so nobody confirmed these "
            f"samples ({NOT_ACCUSED})")


def same_account(username: str) -> str:
    return (f"only peers of the same account ({username}) confirmed these samples: a volunteer's own peers "
            "cannot confirm each other")


@dataclass(frozen=True)
class Decision:
    credited: int
    held: int
    reason: Optional[str]
    agreed: Optional[int] = None  # the value the majority agreed on, when there was one
    disputed: bool = False  # no majority: held until an organizer decides


def view_of(weight: float, claimed: int) -> int:
    """What a receipt says of a claim, in samples: its weight, counted up to the claim (seeing more is no dispute)."""
    return min(max(int(round(weight)), 0), claimed)


def decide(claimed: int, observed_seconds: float, seen_by: Mapping[str, float], ceiling: float, *,
           round_formed: bool = True, members_listed: bool = True, others_in_round: int = 0,
           own_account: Sequence[float] = (), username: str = "", weightless: bool = False,
           in_transit: Collection[str] = ()) -> Decision:
    """Credit ``claimed`` samples as the claimant and the other users of its round agree, up to ``ceiling``
    samples/s over ``observed_seconds``.

    :param seen_by: other user -> what their peers, members of the round, saw of this claim (weight in samples).
        A member is one the claimant's record lists or whose own claim for the round lists the claimant, so a
        griefer can make itself a voice here by listing its victim: one voice, which the victim's own and any
        other user's outvote (with it the only other user, the claim is disputed: an organizer sees both sides)
    :param round_formed: the claim names a round; ``members_listed``: its record lists the round's members
    :param others_in_round: other users among the listed members (for the words when none confirmed)
    :param own_account: what peers of the claimant's own account said they saw (counts for nothing, named)
    :param weightless: every receipt is hivemind's weight 0 itself, not a cut of the aggregator's (zeros, NaN, the
        cap): where the majority agrees on 0 the claim is unconfirmed, not contested
    :param in_transit: other users whose receipts fall short only because parts did not arrive: a shortfall they
        alone explain is credited as far as it arrived and the rest is unconfirmed, neither contested nor disputed
    """
    if claimed <= 0:
        return Decision(0, 0, None)
    plausible = int(ceiling * max(observed_seconds, 0.0))
    views = {user: view_of(weight, claimed) for user, weight in seen_by.items()}
    reasons, agreed, disputed = [], None, False
    if views:
        votes = Counter(views.values())
        votes[claimed] += 1  # the claimant's own word
        value, count = max(votes.items(), key=lambda item: (item[1], -item[0]))
        majority = 2 * count > len(views) + 1
        short = {user for user, view in views.items() if view < claimed}
        if short <= set(in_transit) and (not majority or value < claimed) and not (value == 0 and weightless):
            # every voice below the claim received less only because parts were lost on the way: nobody disagrees
            supported = value if majority else min(views.values())
            agreed = value if majority else None
            reasons.append(LOST.format(seen=supported, claimed=claimed))
        elif majority:
            agreed = supported = value
            if value == 0 and weightless:
                reasons.append(WEIGHTLESS)
            elif value < claimed:
                agreeing = sum(1 for view in views.values() if view == value)
                reasons.append(f"claimed {claimed:,} samples, the peers that averaged with it saw {value:,} "
                               f"({agreeing} of {len(views)} other volunteers agree)")
        else:
            disputed, supported = True, min(views.values())
            if len(views) == 1:
                reasons.append(f"disputed: claimed {claimed:,} samples, the peers that averaged with it saw "
                               f"{supported:,}; with one other volunteer in the round an organizer decides")
            else:
                seen = ", ".join(f"{view:,}" for view in sorted(views.values()))
                reasons.append(f"disputed: claimed {claimed:,} samples, the peers that averaged with it saw "
                               f"{seen} and disagree; an organizer decides")
        if own_account and max(own_account) > supported:
            reasons.append(f"its own account's peers vouched for {int(max(own_account)):,}, which does not count")
    else:
        supported = 0
        if not round_formed:
            reasons.append(NO_ROUND)
        elif not members_listed:
            reasons.append(NO_MEMBERS)
        elif own_account:
            reasons.append(same_account(username or "its owner"))
        elif others_in_round:
            reasons.append(unfinished(others_in_round))
        else:
            reasons.append(ALONE)
    credited = max(min(supported, plausible), 0)
    # an implausible rate is named even where receipts already hold the claim back: it tells the organizer why
    if plausible < (supported if views else claimed):
        rate = claimed / observed_seconds if observed_seconds > 0 else float("inf")
        reasons.append(f"claimed {claimed:,} samples in an epoch the coordinator saw last {observed_seconds:,.1f} s "
                       f"({rate:,.0f} samples/s), ceiling is {ceiling:,.0f}")
    reason = "; ".join(reasons) or None
    return Decision(credited, claimed - credited, reason[:REASON_LENGTH] if reason else None, agreed, disputed)
