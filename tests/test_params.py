import msgspec
import pytest

from engine.messages import EngineCoreRequest
from engine.params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"priority": 2**63}, "priority"),
        ({"priority": -(2**63) - 1}, "priority"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0 and p.max_tokens == 16
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_request_roundtrips_through_msgpack():
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], priority=-3), 1.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["bad"]), type=EngineCoreRequest)
