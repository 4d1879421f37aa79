"""Plans of plain calls (fused_attn.plans): a repeated call skips the checks and the choice, computes
what the full path computes, and lets through nothing the full path refuses."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

import fused_attn
from fused_attn import _extension, functional, ops, plans
from fused_attn.backends import registry
from fused_attn.backends.cpu import CpuBackend
from fused_attn.scores import PLAIN
from test_errors import ATTENTION_ERRORS, qkv  # the refusals of the full path


@pytest.fixture(autouse=True)
def no_plans():
    """Each test starts without plans and leaves none behind."""
    plans.clear()
    yield
    plans.clear()


@pytest.fixture
def choices(monkeypatch):
    """The registry's choices, one per call that takes the full path; a planned call makes none."""
    made = []
    original = registry.choose

    def counting(*args, **kwargs):
        backend = original(*args, **kwargs)
        made.append(backend.name)
        return backend

    monkeypatch.setattr(registry, "choose", counting)
    return made


@pytest.fixture
def kernels(monkeypatch):
    """The names of the backends whose forward ran, one per call."""
    ran = []
    for name in registry.names():
        backend = registry.get(name)

        def forward(*args, _original=backend.forward, _name=name, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, "forward", forward)
    return ran


def layouts(generator, dtype, batch=2, heads_q=4, heads_kv=4, len_q=6, len_k=9, dim_qk=8, dim_v=12, permuted=False):
    """q, k, v, each contiguous or, with `permuted`, each in a layout of its own (what a plan must not
    depend on: strides are not in its key)."""
    shapes = [(batch, heads_q, len_q, dim_qk), (batch, heads_kv, len_k, dim_qk), (batch, heads_kv, len_k, dim_v)]
    orders = [(0, 2, 1, 3), (2, 0, 1, 3), (1, 3, 0, 2)] if permuted else [(0, 1, 2, 3)] * 3
    tensors = []
    for shape, order in zip(shapes, orders):
        stored = torch.randn([shape[i] for i in order], generator=generator).to(dtype)
        tensors.append(stored.permute([order.index(i) for i in range(4)]))
    return tensors


CASES = [
    dict(),
    dict(is_causal=True),
    dict(scale=0.3),
    dict(enable_gqa=True, heads_kv=2),
    dict(is_causal=True, causal_alignment="bottom_right", window_size=(3, None)),
    dict(softcap=2.0),
    dict(backend="cpu", return_lse=True),
    dict(backend="reference", is_causal=True),
]
SHAPE_KEYWORDS = ("heads_kv",)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda case: ",".join(case) or "plain")
def test_a_planned_call_computes_what_the_full_path_does(generator, choices, dtype, case):
    shape = {name: case[name] for name in SHAPE_KEYWORDS if name in case}
    options = {name: value for name, value in case.items() if name not in SHAPE_KEYWORDS}
    fused_attn.attention(*layouts(generator, dtype, **shape), **options)  # makes the plan
    assert len(choices) == 1 and len(plans._plans) == 1
    q, k, v = layouts(generator, dtype, permuted=True, **shape)
    planned = fused_attn.attention(q, k, v, **options)
    assert len(choices) == 1, "the second call was not planned"
    full_out, full_lse = functional._attend(
        q, k, v, None, 0.0, options.get("is_causal", False), options.get("scale"), options.get("enable_gqa", False),
        None, options.get("backend"), seq_first=False, causal_alignment=options.get("causal_alignment", "top_left"),
        window_size=options.get("window_size"), softcap=options.get("softcap"))
    out, lse = planned if options.get("return_lse") else (planned, None)
    assert out.stride() == full_out.stride()
    torch.testing.assert_close(out, full_out, rtol=0, atol=0)
    if lse is not None:
        torch.testing.assert_close(lse, full_lse, rtol=0, atol=0)
    if "backend" not in options and not options.get("window_size") and "softcap" not in options:
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=options.get("is_causal", False),
                                                  scale=options.get("scale"), enable_gqa=options.get("enable_gqa", False))
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_plan_runs_the_backend_of_the_request_in_force(generator, kernels, monkeypatch):
    if fused_attn.available_backends()["cpu"] is not None:
        pytest.skip("the cpu backend is not built: the automatic choice is the reference")
    q, k, v = layouts(generator, torch.float32)
    automatic = "cpu"
    for _ in range(2):
        fused_attn.attention(q, k, v)
    with fused_attn.use_backend("reference"):
        fused_attn.attention(q, k, v)
        fused_attn.attention(q, k, v)
        assert fused_attn.attention(q, k, v, backend=automatic) is not None
    fused_attn.attention(q, k, v)
    monkeypatch.setenv(registry.ENV_VARIABLE, "reference")
    fused_attn.attention(q, k, v)
    with fused_attn.use_backend(automatic):
        fused_attn.attention(q, k, v)
    monkeypatch.setenv(registry.ENV_VARIABLE, "no-such-backend")
    with pytest.raises(ValueError, match="backend: expected one of"):
        fused_attn.attention(q, k, v)
    monkeypatch.delenv(registry.ENV_VARIABLE)
    fused_attn.attention(q, k, v)
    assert kernels == [automatic, automatic, "reference", "reference", automatic, automatic, "reference", automatic,
                       automatic]


def test_registering_a_backend_forgets_the_plans(generator, kernels):
    q, k, v = layouts(generator, torch.float32)
    fused_attn.attention(q, k, v, backend="cpu")
    fused_attn.attention(q, k, v, backend="cpu")
    original = registry.get("cpu")
    replacement = CpuBackend()
    calls = []
    replacement.forward = lambda *args: calls.append(args) or original.forward(*args)
    try:
        registry.register(replacement)
        fused_attn.attention(q, k, v, backend="cpu")
    finally:
        registry.register(original)
    assert len(calls) == 1  # the replacement ran, not the planned backend
    assert kernels == ["cpu", "cpu", "cpu"]


# Equal in Python (and in hash) to what a cached call passed, but refused by the checks.
EQUAL_BUT_REFUSED = [
    ("is_causal=1", dict(is_causal=True), dict(is_causal=1), TypeError, "is_causal: expected a bool"),
    ("scale=True", dict(scale=1.0), dict(scale=True), TypeError, "scale: expected None or a number"),
    ("dropout_p=False", dict(dropout_p=0.0), dict(dropout_p=False), ValueError, "dropout_p: expected a number"),
    ("window bound True", dict(window_size=(1, 0)), dict(window_size=(True, 0)), ValueError, "window_size"),
    ("softcap=True", dict(softcap=1.0), dict(softcap=True), ValueError, "softcap: expected None"),
    ("enable_gqa=False", dict(enable_gqa=True), dict(enable_gqa=False), ValueError, "enable_gqa=True"),
    ("alignment", dict(causal_alignment="bottom_right"), dict(causal_alignment="middle"), ValueError,
     "causal_alignment: expected one of"),
    ("window below -1", dict(window_size=(1, 0)), dict(window_size=(1, -2)), ValueError, "window_size"),
    ("window of three", dict(window_size=(1, 0)), dict(window_size=(1, 0, 0)), TypeError, "window_size"),
    ("negative softcap", dict(softcap=1.0), dict(softcap=-1.0), ValueError, "softcap"),
    ("infinite softcap", dict(softcap=1.0), dict(softcap=float("inf")), ValueError, "softcap"),
]


def refusal(arguments):
    with pytest.raises((TypeError, ValueError)) as raised:
        fused_attn.attention(**arguments)
    return type(raised.value), str(raised.value)


@pytest.mark.parametrize("valid,invalid,error,text", [case[1:] for case in EQUAL_BUT_REFUSED],
                         ids=[case[0] for case in EQUAL_BUT_REFUSED])
def test_a_plan_lets_through_nothing_that_only_compares_equal(valid, invalid, error, text):
    shapes = dict(key=torch.randn(2, 2, 5, 8), value=torch.randn(2, 2, 5, 8)) if "enable_gqa" in valid else {}
    before = refusal(dict(qkv(**shapes), **invalid))
    for _ in range(2):
        fused_attn.attention(**qkv(**shapes), **valid)
    assert len(plans._plans) == 1
    assert refusal(dict(qkv(**shapes), **invalid)) == before
    assert before[0] is error and text in before[1]


@pytest.mark.parametrize("arguments,error,text", [case[1:] for case in ATTENTION_ERRORS],
                         ids=[case[0] for case in ATTENTION_ERRORS])
def test_every_refusal_holds_after_a_plan_of_its_valid_call(arguments, error, text):
    before = refusal(arguments)
    for _ in range(2):
        fused_attn.attention(**qkv())
        fused_attn.attention(**qkv(key=torch.randn(2, 2, 5, 8), value=torch.randn(2, 2, 5, 8)), enable_gqa=True)
    assert len(plans._plans) == 2
    assert refusal(arguments) == before
    assert before[0] is error and text in before[1]


@pytest.mark.parametrize("arguments", [
    dict(is_causal=1), dict(scale=True), dict(dropout_p=False), dict(dropout_p=0), dict(scale=1),
    dict(window_size=[1, 0]), dict(window_size=(True, 0)), dict(softcap=0.0), dict(softcap=-0.0), dict(softcap=2),
    dict(softcap=True), dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)),
    dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), dict(alibi_slopes=torch.ones(4)),
    dict(generator=torch.Generator()), dict(causal_alignment=0), dict(enable_gqa=1), dict(backend=b"cpu"),
], ids=lambda arguments: ",".join(f"{name}={value!r}" if isinstance(value, (int, float, str, bytes, tuple, list))
                                  else name for name, value in arguments.items()))
def test_calls_that_are_not_plain_get_no_key(arguments):
    tensors = qkv()
    call = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, key_padding_mask=None,
                backend=None, generator=None, causal_alignment="top_left", window_size=None, softcap=None,
                alibi_slopes=None)
    assert plans.key_of(tensors["query"], tensors["key"], tensors["value"], **call) is not None
    assert plans.key_of(tensors["query"], tensors["key"], tensors["value"], **dict(call, **arguments)) is None


def test_valid_calls_without_a_key_still_run(choices):
    tensors = qkv()
    for arguments, plain in ((dict(window_size=[1, 0]), dict(window_size=(1, 0))), (dict(softcap=2), dict(softcap=2.0)),
                             (dict(dropout_p=0), dict(dropout_p=0.0)), (dict(scale=1), dict(scale=1.0))):
        expected = fused_attn.attention(**tensors, **plain)
        choices.clear()
        for _ in range(2):
            torch.testing.assert_close(fused_attn.attention(**tensors, **arguments), expected, rtol=0, atol=0)
        assert len(choices) == 2, arguments  # the full path, each time


def test_the_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "_MAX_PLANS", 2)
    for length in range(1, 6):
        fused_attn.attention(*(torch.randn(1, 1, length, 4) for _ in range(3)))
        assert 1 <= len(plans._plans) <= 2


def test_an_explicit_backend_outside_its_devices_is_not_remembered():
    q = torch.randn(1, 1, 2, 4)
    outside = type("Elsewhere", (CpuBackend,), {"devices": ("cuda",)})()
    plans.remember(("key",), outside, PLAIN, 0.5, q, q)
    assert plans._plans == {}
    plans.remember(("key",), registry.get("reference"), PLAIN, 0.5, q, q)
    assert ("key",) in plans._plans


def test_gradients_still_flow_through_the_op(generator, monkeypatch):
    q, k, v = layouts(generator, torch.float32)
    fused_attn.attention(q, k, v, is_causal=True)
    fused_attn.attention(q, k, v, is_causal=True)
    entered = []
    original = ops.attention_fwd
    monkeypatch.setattr(ops, "attention_fwd", lambda *args: entered.append(args[10]) or original(*args))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fused_attn.attention(*leaves, is_causal=True)
    assert entered and out.grad_fn is not None
    grads = torch.autograd.grad(out.square().sum(), leaves)
    expected_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*expected_leaves, is_causal=True)
    expected_grads = torch.autograd.grad(expected.square().sum(), expected_leaves)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # no gradient to record: the plan serves inputs that require grad too
        torch.testing.assert_close(fused_attn.attention(*leaves, is_causal=True), out.detach(), rtol=0, atol=0)
    assert len(entered) == 1


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD's import
def test_forward_mode_ad_is_still_refused():
    tensors = qkv()
    fused_attn.attention(**tensors)
    fused_attn.attention(**tensors)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(tensors["query"], torch.randn_like(tensors["query"]))
        with pytest.raises(NotImplementedError, match="query: forward-mode AD"):
            fused_attn.attention(**dict(tensors, query=dual))


def test_compiled_functions_still_trace_the_call(generator, choices):
    torch._dynamo.reset()
    q, k, v = layouts(generator, torch.float32)
    eager = fused_attn.attention(q, k, v, is_causal=True)
    fused_attn.attention(q, k, v, is_causal=True)
    compiled = torch.compile(lambda q, k, v: fused_attn.attention(q, k, v, is_causal=True) * 2, fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), eager * 2, rtol=0, atol=0)
    torch._dynamo.reset()
    assert len(choices) >= 2  # the trace took the full path


def test_planned_calls_of_the_cpu_backend_enter_the_extension_directly(generator, monkeypatch):
    """`_C.plain_forward` allocates the output and runs the cpu kernel: the same result as the full path,
    in the output layout of `output_like`."""
    if _extension._C is None or fused_attn.available_backends()["cpu"] is not None:
        pytest.skip("the cpu backend is not built")
    entered = []

    def plain_forward(*args, _original=_extension._C.plain_forward):
        entered.append(args[3:])
        return _original(*args)

    monkeypatch.setattr(_extension._C, "plain_forward", plain_forward)
    q, k, v = layouts(generator, torch.float32, permuted=True)
    keywords = dict(is_causal=True, causal_alignment="bottom_right", window_size=(3, None), softcap=5.0,
                    return_lse=True)
    plans.clear()
    expected = fused_attn.attention(q, k, v, **keywords)
    got = fused_attn.attention(q, k, v, **keywords)
    assert entered == [(True, 8 ** -0.5, 3, -1, True, 5.0, 0)]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[0].stride() == expected[0].stride()
    with pytest.raises(TypeError, match="plain_forward: query: expected a torch.Tensor"):
        _extension._C.plain_forward(None, k, v, True, 1.0, -1, -1, False, 0.0, 0)
