"""Peer tokens and admission: the pieces, and the hivemind internals they rely on (pinned)."""

from __future__ import annotations

import inspect
import time

import hivemind
import pytest
from dedloc_common.signing import load_public_openssh, new_private_key, peer_id_of, public_openssh, sign, verify
from dedloc_worker.admission.gate import AdmissionState, TokenCheck, admitted_peers, guard_handlers, parse_expiration
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon import P2PContext
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from app.authority import tokens
from app.core.config import Settings
from app.core.errors import Forbidden, Invalid, TooManyRequests
from app.runs import registry
from tests.support.factories import peer_token


def test_portal_signatures_verify_with_hivemind():
    """The portal signs without hivemind; hivemind's own RSAPublicKey.verify must accept it."""
    authority = new_private_key()
    data = b"alice key 2030-01-01T00:00:00"
    assert RSAPublicKey.from_bytes(public_openssh(authority)).verify(data, sign(authority, data).encode())
    assert not RSAPublicKey.from_bytes(public_openssh(authority)).verify(data + b"!", sign(authority, data).encode())


def test_peer_id_of_a_token_key_is_the_libp2p_peer_id():
    key = RSAPrivateKey()
    identity = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes()).SerializeToString()
    assert peer_id_of(key.get_public_key().to_bytes()) == str(PeerID.from_identity(identity))


def test_token_check_names_what_is_wrong():
    authority, stranger, peer = new_private_key(), new_private_key(), RSAPrivateKey()
    check = TokenCheck(public_openssh(authority).decode())
    assert check.verdict(peer_token(authority, "alice", peer)) == ""
    assert "signature" in check.verdict(peer_token(stranger, "alice", peer))
    assert "expired" in check.verdict(peer_token(authority, "alice", peer, lifetime=-5))
    assert "banned" in check.verdict(peer_token(authority, "alice", peer), frozenset({"alice"}))
    forged = peer_token(authority, "alice", peer)
    forged.username = "mallory"  # a valid signature over another name
    assert "signature" in check.verdict(forged)


def test_admitted_peers_keep_only_valid_tokens(tmp_path):
    authority = new_private_key()
    check = TokenCheck(public_openssh(authority).decode())
    good, banned, expired = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    peers = admitted_peers([peer_token(authority, "alice", good), peer_token(authority, "bob", banned),
                            peer_token(authority, "carol", expired, lifetime=-1)], check, frozenset({"bob"}))
    assert list(peers) == [peer_id_of(good.get_public_key().to_bytes())]
    state = AdmissionState(tmp_path)
    state.write_admitted(peers, ["bob"])
    assert state.admits(next(iter(peers))) and not state.admits(peer_id_of(banned.get_public_key().to_bytes()))
    assert state.denied() == {"bob"}


def test_hivemind_internals_admission_relies_on():
    """If an upgrade moves any of these, the admission layer silently stops protecting: fail loudly instead."""
    assert hivemind.__version__ == "1.1.12"
    parameters = list(inspect.signature(P2P.add_protobuf_handler).parameters)
    assert parameters[:4] == ["self", "name", "handler", "input_protobuf_type"]
    assert {"stream_input", "stream_output", "balanced"} <= set(parameters)
    assert "remote_id" in P2PContext.__dataclass_fields__
    for method in ("get_token", "is_token_valid", "does_token_need_refreshing"):
        assert method in TokenAuthorizerBase.__abstractmethods__
    from hivemind.dht.protocol import DHTProtocol

    assert DHTProtocol._get_handle_name(None, "rpc_find") == "DHTProtocol.rpc_find"
    from hivemind.averaging.averager import DecentralizedAverager

    names = {handler for handler in dir(DecentralizedAverager) if handler.startswith("rpc_")}
    assert {"rpc_join_group", "rpc_aggregate_part", "rpc_download_state"} <= names


def test_guard_wraps_every_non_dht_handler(tmp_path):
    state = AdmissionState(tmp_path)
    original = P2P.add_protobuf_handler
    try:
        guard_handlers(state)
        guard_handlers(state)  # twice is harmless: it wraps the original, not itself
        assert P2P.add_protobuf_handler.__wrapped__ is original
    finally:
        P2P.add_protobuf_handler = original


@pytest.fixture
def run(sessions):
    with sessions() as session:
        yield session, registry.create_run(session, slug="adm", title="Admission")


def test_issued_tokens_are_recorded_and_verify(run, tmp_path):
    session, the_run = run
    settings = Settings(data_dir=tmp_path, peer_token_lifetime=120)
    peer = RSAPrivateKey()
    grant = tokens.issue_peer_token(session, settings, the_run, "alice", peer.get_public_key().to_bytes().decode())
    check = TokenCheck(grant.authority_public_key)
    token = AccessToken(username="alice", public_key=grant.token.public_key.encode(),
                        expiration_time=grant.token.expiration_time, signature=grant.token.signature.encode())
    assert check.verdict(token) == ""
    assert 100 < parse_expiration(grant.token.expiration_time) - time.time() <= 121
    assert tokens.token_holders(session, the_run)[0][:2] == ("alice", 1)
    # The authority key is stored encrypted: the clear DER is nowhere in the row.
    assert b"BEGIN" not in the_run.authority_key_encrypted and len(the_run.authority_key_encrypted) > 1000


def test_the_authority_key_is_parsed_once_per_process_and_still_signs(run, tmp_path):
    """Parsing the key cost 34 ms of CPU, at every coordinator poll and every token or denylist request."""
    session, the_run = run
    settings = Settings(data_dir=tmp_path)
    tokens.authority_key(session, settings, the_run)  # created and stored encrypted
    first = tokens.authority_key(session, settings, the_run)
    assert tokens.authority_key(session, settings, the_run) is first  # the parsed key, not a new parse
    public = load_public_openssh(tokens.authority_public_key(session, settings, the_run))
    assert verify(public, b"payload", sign(first, b"payload"))
    # another run's key is its own
    other = registry.create_run(session, slug="adm2", title="Another")
    assert tokens.authority_public_key(session, settings, other) != tokens.authority_public_key(session, settings,
                                                                                              the_run)


def test_admission_policy_bans_and_limits(run, tmp_path):
    session, the_run = run
    settings = Settings(data_dir=tmp_path, peer_token_requests_per_minute=3, max_concurrent_peers=2)
    key = lambda: RSAPrivateKey().get_public_key().to_bytes().decode()  # noqa: E731
    tokens.issue_peer_token(session, settings, the_run, "alice", key())
    tokens.issue_peer_token(session, settings, the_run, "alice", key())
    with pytest.raises(TooManyRequests, match="already runs 2 peers"):
        tokens.issue_peer_token(session, settings, the_run, "alice", key())
    with pytest.raises(Invalid, match="OpenSSH"):
        tokens.issue_peer_token(session, settings, the_run, "bob", "ssh-rsa garbage")
    tokens.ban_user(session, the_run, "bob", banned_by="org")
    with pytest.raises(Forbidden, match="banned"):
        tokens.issue_peer_token(session, settings, the_run, "bob", key())
    tokens.unban_user(session, the_run, "bob")
    tokens.issue_peer_token(session, settings, the_run, "bob", key())
    the_run.admission = "allowlist"
    session.commit()
    with pytest.raises(Forbidden, match="allowlisted"):
        tokens.issue_peer_token(session, settings, the_run, "carol", key())
    tokens.set_admission(session, the_run, "org", "bigscience")
    with pytest.raises(Forbidden, match="members of the bigscience organization"):
        tokens.issue_peer_token(session, settings, the_run, "carol", key(), organizations=["other-org"])
    tokens.issue_peer_token(session, settings, the_run, "carol", key(), organizations=["bigscience"])
    with pytest.raises(Invalid, match="name the Hugging Face organization"):
        tokens.set_admission(session, the_run, "org", "")
    denylist = tokens.signed_denylist(session, settings, the_run)
    assert denylist["usernames"] == []
    the_run.admission = "open"
    session.commit()
    same_key = key()
    tokens.issue_peer_token(session, settings, the_run, "bob", same_key)  # bob's 2nd and 3rd request this minute
    tokens.issue_peer_token(session, settings, the_run, "bob", same_key)
    with pytest.raises(TooManyRequests, match="more than 3 token requests in a minute"):
        tokens.issue_peer_token(session, settings, the_run, "bob", same_key)


def test_an_expired_token_with_the_portal_unreachable_holds_training_in_one_line_until_a_new_one_comes(tmp_path):
    import threading

    from dedloc_common.contract import PeerToken
    from dedloc_worker.admission.keeper import AdmissionKeeper
    from dedloc_worker.admission.renewal import EXPIRED_RETRY_SECONDS
    from dedloc_worker.errors import PortalError

    authority, peer = new_private_key(), RSAPrivateKey()
    state = AdmissionState(tmp_path)
    state.write_token(peer_token(authority, "alice", peer, lifetime=-1))
    portal: dict = {"up": False}

    def refresh():
        if not portal["up"]:
            raise PortalError("cannot reach the portal at http://portal.invalid")
        fresh = peer_token(authority, "alice", peer, lifetime=600)
        return PeerToken(username=fresh.username, public_key=fresh.public_key.decode(),
                         expiration_time=fresh.expiration_time, signature=fresh.signature.decode())

    said: list[str] = []
    stop = threading.Event()
    keeper = AdmissionKeeper(None, "run", state, TokenCheck(public_openssh(authority).decode()), None,
                             refresh, stop, say=said.append)
    keeper._refresh_if_needed()
    keeper.renewal.next_try = 0.0  # the next try is due (EXPIRED_RETRY_SECONDS later, in a running keeper)
    keeper._refresh_if_needed()
    # held, said once, not stopped: peers refuse the expired token, the worker waits for the portal
    assert keeper.expired.is_set() and not stop.is_set() and keeper.failure is None
    assert said == ["this peer's token expired and the portal cannot renew it (cannot reach the portal at "
                    "http://portal.invalid): peers refuse an expired token, so training holds; asking the portal "
                    f"every {EXPIRED_RETRY_SECONDS:.0f} s, and training resumes once it answers"]
    portal["up"] = True
    keeper.renewal.next_try = 0.0
    keeper._refresh_if_needed()
    assert not keeper.expired.is_set() and said[-1].startswith("the portal is back: peer token renewed (valid ")
    assert state.read_token().expiration_time == keeper.token.expiration_time


def test_organizations_come_from_the_orgs_claim():
    from app.identity.oidc import organizations_of

    assert organizations_of({"orgs": [{"preferred_username": "bigscience"}, {"name": "huggingface"}, "plain"]}) == (
        "bigscience", "huggingface", "plain")
    assert organizations_of({}) == ()

