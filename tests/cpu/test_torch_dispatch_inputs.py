"""The host-side checks of ``p3send.moe.TorchDispatchRank.dispatch`` (``rank_dispatch_problems``),
on the stand-in torch of test_dispatch_inputs (so they run where torch is not installed):
each wrong dtype, shape, device or layout named, with what was expected and what was given;
the dispatch op's handle lookup refuses other ops' objects. tests/gpu/test_torch_dispatch.py
runs the class itself on a GPU."""
from __future__ import annotations

import pytest

from p3send.abi.errors import ConfigError
from p3send.ops.dispatch import DispatchShape
from tests.cpu.test_dispatch_inputs import FakeTensor, TorchDevice, fake, torch_mods  # noqa: F401 (fixtures)

T, K, H = 3, 2, 512


class Tensor(FakeTensor):
    """A stand-in tensor with a device and a layout."""

    def __init__(self, *shape, dtype, device="cuda:0", contiguous=True):
        super().__init__(*shape, dtype=dtype)
        self.device, self.contiguous = TorchDevice(device), contiguous

    def is_contiguous(self):
        return self.contiguous


def good(payload="bf16"):
    x = Tensor(T, H, dtype="float8_e4m3fn" if payload == "fp8" else "bfloat16")
    sc = Tensor(T, H // 128, dtype="float32") if payload == "fp8" else None
    return dict(x=x, topk_idx=Tensor(T, K, dtype="int64"), topk_weights=Tensor(T, K, dtype="float32"), scales=sc)


def problems(moe, payload="bf16", **change):
    shape = DispatchShape(4, 2, K, 8, H, payload)
    return moe.rank_dispatch_problems(shape, 0, **{**good(payload), **change})


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_good_inputs_have_no_problem(torch_mods, payload):  # noqa: F811 (a fixture)
    _, moe = torch_mods
    assert problems(moe, payload) == []
    assert problems(moe, payload, topk_idx=Tensor(T, K, dtype="int32")) == []


@pytest.mark.parametrize("payload,change,words", [
    ("bf16", dict(x=Tensor(T, H, dtype="float32")), "x: expected dtype bfloat16, got float32"),
    ("fp8", dict(x=Tensor(T, H, dtype="bfloat16")), "x: expected dtype float8_e4m3fn, got bfloat16"),
    ("bf16", dict(topk_idx=Tensor(T, K, dtype="float32")), "topk_idx: expected dtype int32 or int64, got float32"),
    ("bf16", dict(topk_weights=Tensor(T, K, dtype="bfloat16")), "topk_weights: expected dtype float32, got bfloat16"),
    ("fp8", dict(scales=Tensor(T, H // 128, dtype="float16")), "scales: expected dtype float32, got float16"),
    ("bf16", dict(x=Tensor(T, H, dtype="bfloat16", device="cpu")), "x: expected a tensor on cuda:0, got one on cpu"),
    ("bf16", dict(topk_idx=Tensor(T, K, dtype="int32", device="cuda:1")),
     "topk_idx: expected a tensor on cuda:0, got one on cuda:1"),
    ("bf16", dict(x=Tensor(T, H, dtype="bfloat16", contiguous=False)),
     "x: expected a contiguous tensor, got a non-contiguous one"),
    ("bf16", dict(topk_idx=Tensor(T, K + 1, dtype="int32")), "topk_idx: expected shape (T <= 8, 2), got (3, 3)"),
    ("bf16", dict(topk_idx=Tensor(9, K, dtype="int32")), "topk_idx: expected shape (T <= 8, 2), got (9, 2)"),
    ("bf16", dict(topk_idx=Tensor(T, dtype="int32")), "topk_idx: expected shape (T <= 8, 2), got (3,)"),
    ("bf16", dict(x=Tensor(T + 1, H, dtype="bfloat16")), "x: expected shape (3, 512) as topk_idx, got (4, 512)"),
    ("bf16", dict(x=Tensor(T, H // 2, dtype="bfloat16")), "x: expected shape (3, 512) as topk_idx, got (3, 256)"),
    ("bf16", dict(topk_weights=Tensor(T, K + 1, dtype="float32")),
     "topk_weights: expected shape (3, 2) as topk_idx, got (3, 3)"),
    ("fp8", dict(scales=Tensor(T, H // 64, dtype="float32")), "scales: expected shape (3, 4) as topk_idx, got (3, 8)"),
    ("fp8", dict(scales=None), "scales: expected a torch.Tensor, got NoneType"),
    ("bf16", dict(scales=Tensor(T, 4, dtype="float32")), "scales: expected None for a bf16 payload, got Tensor"),
    ("bf16", dict(x=[[0] * H] * T), "x: expected a torch.Tensor, got list"),
])
def test_each_bad_input_is_named(torch_mods, payload, change, words):  # noqa: F811 (a fixture)
    _, moe = torch_mods
    got = problems(moe, payload, **change)
    assert got == [words], got


def test_every_problem_is_listed_at_once(torch_mods):  # noqa: F811 (a fixture)
    _, moe = torch_mods
    got = problems(moe, x=Tensor(T, H, dtype="float32", device="cpu"), topk_weights=Tensor(T, 1, dtype="float64"))
    assert [p.split(":")[0] for p in got] == ["x", "x", "topk_weights", "topk_weights"], got


def test_the_dispatch_op_refuses_a_handle_of_another_kind(torch_mods):  # noqa: F811 (a fixture)
    pt, moe = torch_mods
    h = pt.register(object())
    with pytest.raises(ConfigError, match="handle: no open p3send dispatch"):
        moe.dispatch(h, *[None] * 10)
    pt.unregister(h)
