"""Finish reasons and error kinds are StrEnums (shared/protocol.py) whose values are the
strings the protocol carried before: msgspec encodes them as those plain strings, byte for
byte, decodes them back to members, and members compare equal to the strings."""

from __future__ import annotations

import msgspec
import pytest

from shared import protocol as P

# The wire strings (the OpenAI finish reasons and the frontend's error mapping read them).
FINISH = ["stop", "length", "abort", "error"]
KINDS = ["invalid", "overloaded", "internal", "unavailable"]


def test_the_members_are_exactly_the_wire_strings():
    assert [m.value for m in P.FinishReason] == FINISH
    assert [m.value for m in P.ErrorKind] == KINDS
    assert all(isinstance(m, str) and m == m.value and str(m) == m.value
               for m in [*P.FinishReason, *P.ErrorKind])


@pytest.mark.parametrize("reason", FINISH)
@pytest.mark.parametrize("kind", [None, *KINDS])
def test_outputs_encode_as_plain_strings_and_decode_to_members(reason, kind):
    enc, dec = P.encoder(), P.decoder(P.EngineToFrontend)
    as_str = P.RequestOutput("r1", [1, 2], 3, reason, error="x" if kind else None, error_kind=kind)
    as_enum = P.RequestOutput("r1", [1, 2], 3, P.FinishReason(reason), error="x" if kind else None,
                              error_kind=P.ErrorKind(kind) if kind else None)
    wire = enc.encode(P.Outputs([as_enum]))
    assert wire == enc.encode(P.Outputs([as_str]))
    # the fields are msgpack strings: a schema-less decoder sees the plain values
    raw = msgspec.msgpack.decode(wire)
    assert reason in raw[1][0] and (kind is None or kind in raw[1][0])
    out = dec.decode(wire).outputs[0]
    assert out.finish_reason is P.FinishReason(reason) and out.finish_reason == reason
    assert out.error_kind == kind and (kind is None or out.error_kind is P.ErrorKind(kind))
    assert msgspec.json.encode(out.finish_reason) == f'"{reason}"'.encode()


def test_a_running_request_has_no_finish_reason_on_the_wire():
    enc, dec = P.encoder(), P.decoder(P.EngineToFrontend)
    out = dec.decode(enc.encode(P.Outputs([P.RequestOutput("r", [4], 1)]))).outputs[0]
    assert out.finish_reason is None and out.error_kind is None


def test_an_unknown_finish_reason_is_a_decode_error():
    enc, dec = P.encoder(), P.decoder(P.EngineToFrontend)
    with pytest.raises(msgspec.ValidationError):
        dec.decode(enc.encode(P.Outputs([P.RequestOutput("r", [], 0, "bored")])))
