"""replace_attention on PyTorch's transformer modules in inference, where PyTorch's own fast paths
(torch._transformer_encoder_layer_fwd, nested tensors in nn.TransformerEncoder) would bypass the
attention module: the fused op runs, and outputs are PyTorch's (fast path on) by the project's
criterion, padded positions included."""

import contextlib
import copy
import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fused_attn
from fused_attn.testing import allowed_error, max_error

# Even heads: PyTorch's fast paths refuse odd ones, and they are what is under test.
EMBED, HEADS, FEEDFORWARD, BATCH, LENGTH, LAYERS = 16, 4, 24, 3, 6, 2
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
    pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask"),  # the float_mask case
]


class OpLog(TorchDispatchMode):
    """Records every op that runs, and for fused_attn's ops the backend that ran them.

    A dispatch mode is not a torch function mode, so PyTorch's fast-path checks
    (`has_torch_function`) still choose as they would without it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name.startswith("fused_attn."):
            bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            name += f":{bound['backend']}"
        self.ops.append(name)
        return func(*args, **kwargs)

    def fused(self):
        return [op for op in self.ops if op.startswith("fused_attn.attention_fwd:")]


def logged(fn, *args, **kwargs):
    with OpLog() as log:
        return fn(*args, **kwargs), log


def assert_fused(log, calls):
    """`calls` attention calls ran on a fused backend, and none on PyTorch's fused layer or MHA."""
    assert len(log.fused()) == calls, log.ops
    assert all(not op.endswith(":reference") for op in log.fused()), log.fused()
    assert not {"aten._transformer_encoder_layer_fwd", "aten._native_multi_head_attention"} & set(log.ops)


def randomize(model, generator):
    """Random weights and non-zero biases and norm parameters, so every parameter is exercised."""
    with torch.no_grad():
        for parameter in model.parameters():
            scale = parameter.shape[-1] ** -0.5 if parameter.dim() > 1 else 0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return model


def versions(model, dtype):
    """PyTorch's model in float64 (the exact reference) and in `dtype`, and the replaced one in `dtype`."""
    exact = model.double().eval()
    theirs = copy.deepcopy(model).to(dtype).eval()
    ours = fused_attn.replace_attention(copy.deepcopy(model).to(dtype).eval())
    return exact, theirs, ours


def assert_close(name, actual, exact, same_dtype, dtype):
    """The project's criterion: error against float64 at most twice PyTorch's own, plus the floor."""
    assert not torch.isnan(actual).any(), name
    exact, same_dtype = exact.detach().double(), same_dtype.detach()
    error, allowed = max_error(actual, exact), allowed_error(name, exact, same_dtype, dtype)
    assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def source(generator, batch_first, dtype=torch.float64, length=LENGTH):
    shape = (BATCH, length, EMBED) if batch_first else (length, BATCH, EMBED)
    return torch.randn(shape, generator=generator, dtype=dtype)


def right_padding(generator, length=LENGTH):
    """(B, L), True = padding, at the end of each sequence (left-aligned, as nested tensors need);
    lengths drawn from 1..L, one of them shorter than L."""
    lengths = torch.randint(1, length + 1, (BATCH,), generator=generator)
    lengths[0] = length - 2
    return torch.arange(length) >= lengths[:, None]


def masks(generator, kind):
    """(src_mask, src_key_padding_mask, is_causal) in nn's convention (bool True = hidden)."""
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
    if kind == "padding":
        return None, right_padding(generator), None
    if kind == "left_padding":  # not left-aligned: PyTorch keeps the padded tensor
        return None, right_padding(generator).flip(-1), None
    if kind == "causal":
        return causal, None, True
    if kind == "float_causal":  # detected as causal by nn.TransformerEncoder
        return nn.Transformer.generate_square_subsequent_mask(LENGTH, dtype=torch.float64), None, None
    if kind == "padding_causal":
        return causal, right_padding(generator), True
    hidden = torch.rand(LENGTH, LENGTH, generator=generator) < 0.3
    hidden[:, 0] = False
    return torch.randn(LENGTH, LENGTH, generator=generator, dtype=torch.float64).masked_fill(hidden, -torch.inf), \
        right_padding(generator), False


@contextlib.contextmanager
def pytorch_fast_path(enabled):
    """PyTorch's fast path treats a float mask as a bool one (any non-zero hides: pytorch/pytorch#118628,
    NaN for random additive masks); for those, the reference is PyTorch's regular path."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def cast(mask, dtype):
    return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)


def activation_of(name):
    return {"relu": "relu", "gelu": "gelu", "callable": F.silu}[name]


ENCODER_CASES = list(itertools.product(
    DTYPES, [True, False], [False, True], ["relu", "gelu", "callable"],
    ["padding", "left_padding", "causal", "float_causal", "padding_causal", "float_mask"]))


@pytest.mark.parametrize("dtype,batch_first,norm_first,activation,mask_kind", ENCODER_CASES)
def test_encoder_in_inference_runs_fused_and_matches_pytorch(generator, dtype, batch_first, norm_first,
                                                             activation, mask_kind):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=batch_first, norm_first=norm_first,
                                       activation=activation_of(activation), dtype=torch.float64)
    model = randomize(nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=True), generator)
    exact_model, theirs_model, ours_model = versions(model, dtype)
    src = source(generator, batch_first)
    src_mask, padding, is_causal = masks(generator, mask_kind)

    def run(module, dtype):
        return module(src.to(dtype), mask=cast(src_mask, dtype), src_key_padding_mask=padding, is_causal=is_causal)

    with torch.no_grad():
        with pytorch_fast_path(mask_kind != "float_mask"):
            exact = run(exact_model, torch.float64)
            theirs, their_log = logged(run, theirs_model, dtype)
        ours, our_log = logged(run, ours_model, dtype)
    assert_fused(our_log, LAYERS)
    assert_close("out", ours, exact, theirs, dtype)
    nested = "aten._nested_tensor_from_mask" in their_log.ops
    # PyTorch nests exactly where its conditions hold; so does the replaced encoder.
    assert nested == (mask_kind == "padding" and batch_first and not norm_first and activation != "callable")
    assert nested == ("aten._nested_tensor_from_mask" in our_log.ops)
    if nested:  # PyTorch's convention: zeros at the padded positions
        assert (theirs[padding] == 0).all() and (ours[padding] == 0).all()


@pytest.mark.parametrize("dtype,batch_first,norm_first,mask_kind", list(itertools.product(
    DTYPES, [True, False], [False, True], ["padding", "causal", "padding_causal", "float_mask", None])))
def test_bare_layer_in_inference_runs_fused_and_matches_pytorch(generator, dtype, batch_first, norm_first,
                                                                mask_kind):
    torch.manual_seed(0)
    layer = randomize(nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=batch_first,
                                                 norm_first=norm_first, activation="gelu", dtype=torch.float64),
                      generator)
    exact_layer, theirs_layer, ours_layer = versions(layer, dtype)
    src = source(generator, batch_first)
    src_mask, padding, is_causal = masks(generator, mask_kind) if mask_kind else (None, None, None)

    def run(module, dtype):
        return module(src.to(dtype), src_mask=cast(src_mask, dtype), src_key_padding_mask=padding,
                      is_causal=bool(is_causal))

    fast_path = mask_kind != "float_mask"
    with torch.no_grad():
        with pytorch_fast_path(fast_path):
            exact = run(exact_layer, torch.float64)
            theirs, their_log = logged(run, theirs_layer, dtype)
        ours, our_log = logged(run, ours_layer, dtype)
    assert ("aten._transformer_encoder_layer_fwd" in their_log.ops) == (batch_first and fast_path)
    assert_fused(our_log, 1)
    assert_close("out", ours, exact, theirs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_takes_a_nested_batch_as_pytorch_does(generator, dtype):
    layer = randomize(nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True,
                                                 dtype=torch.float64), generator)
    exact_layer, theirs_layer, ours_layer = versions(layer, dtype)
    sequences = [torch.randn(length, EMBED, generator=generator, dtype=torch.float64) for length in (5, 2, 6)]

    def run(module, dtype):
        out = module(torch.nested.as_nested_tensor([s.to(dtype) for s in sequences]))
        assert out.is_nested
        return out.to_padded_tensor(0.0)

    with torch.no_grad():
        exact = run(exact_layer, torch.float64)
        theirs = run(theirs_layer, dtype)
        ours, our_log = logged(run, ours_layer, dtype)
    assert_fused(our_log, 1)
    assert_close("out", ours, exact, theirs, dtype)
    nested = torch.nested.as_nested_tensor(sequences)
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        ours_layer.double()(nested, src_key_padding_mask=torch.zeros(3, 6, dtype=torch.bool))


def test_unaligned_padding_without_mask_check_is_pytorch_output(generator):
    """With mask_check=False PyTorch nests a padding that is not at the end as if it were (each
    sequence's leading positions): the replaced encoder gives that very output."""
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True, dtype=torch.float64)
    model = randomize(nn.TransformerEncoder(layer, LAYERS, mask_check=False), generator)
    _, theirs_model, ours_model = versions(model, torch.float64)
    src, padding = source(generator, True), right_padding(generator).flip(-1)
    with torch.no_grad():
        theirs = theirs_model(src, src_key_padding_mask=padding)
        ours, our_log = logged(ours_model, src, src_key_padding_mask=padding)
    assert_fused(our_log, LAYERS)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype,batch_first,norm_first", list(itertools.product(DTYPES, [True, False], [False, True])))
def test_transformer_in_inference_runs_fused_and_matches_pytorch(generator, dtype, batch_first, norm_first):
    torch.manual_seed(0)
    model = randomize(nn.Transformer(EMBED, HEADS, LAYERS, LAYERS, FEEDFORWARD, batch_first=batch_first,
                                     norm_first=norm_first, dtype=torch.float64), generator)
    exact_model, theirs_model, ours_model = versions(model, dtype)
    src, tgt = source(generator, batch_first), source(generator, batch_first, length=LENGTH - 1)
    src_padding = right_padding(generator)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(LENGTH - 1, dtype=torch.float64)

    def run(module, dtype):
        return module(src.to(dtype), tgt.to(dtype), tgt_mask=tgt_mask.to(dtype), src_key_padding_mask=src_padding,
                      memory_key_padding_mask=src_padding, tgt_is_causal=True)

    with torch.no_grad():
        exact = run(exact_model, torch.float64)
        theirs = run(theirs_model, dtype)
        ours, our_log = logged(run, ours_model, dtype)
    assert_fused(our_log, LAYERS + 2 * LAYERS)  # self-attention per encoder layer, two per decoder layer
    assert_close("out", ours, exact, theirs, dtype)


@pytest.mark.parametrize("dtype,norm_first", list(itertools.product(DTYPES, [False, True])))
def test_gradients_match_pytorch(generator, dtype, norm_first):
    """In eval with gradients, PyTorch takes its regular path: outputs and every gradient by the criterion."""
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True, norm_first=norm_first,
                                       dtype=torch.float64)
    model = randomize(nn.TransformerEncoder(layer, LAYERS), generator)
    exact_model, theirs_model, ours_model = versions(model, dtype)
    src = source(generator, True)
    src_mask, padding, _ = masks(generator, "padding_causal")
    weights = torch.randn(src.shape, generator=generator, dtype=torch.float64)

    def run(module, dtype):
        inputs = src.to(dtype).requires_grad_()
        out = module(inputs, mask=src_mask, src_key_padding_mask=padding, is_causal=True)
        grads = torch.autograd.grad((out * weights.to(dtype)).sum(), [inputs, *module.parameters()])
        return out, grads

    exact, theirs = run(exact_model, torch.float64), run(theirs_model, dtype)
    ours, our_log = logged(run, ours_model, dtype)
    assert_fused(our_log, LAYERS)
    assert_close("out", ours[0], exact[0], theirs[0], dtype)
    names = ["src"] + [name for name, _ in ours_model.named_parameters()]
    for name, grad, exact_grad, their_grad in zip(names, ours[1], exact[1], theirs[1]):
        assert_close(f"grad {name}", grad, exact_grad, their_grad, dtype)


def test_training_with_dropout_runs_fused_and_reproduces_a_seed(generator):
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, dropout=0.2, batch_first=True)
    model = fused_attn.replace_attention(nn.TransformerEncoder(layer, LAYERS)).train()
    src, padding = source(generator, True, torch.float32), right_padding(generator)

    def step(seed):
        torch.manual_seed(seed)
        out = model(src, src_key_padding_mask=padding)
        return out, torch.autograd.grad(out.square().sum(), list(model.parameters()))

    (first, first_grads), log = logged(step, 3)
    assert_fused(log, LAYERS)
    assert all(op.startswith("fused_attn.attention_fwd:") for op in log.fused())
    second, second_grads = step(3)
    other, _ = step(4)
    assert torch.equal(first, second) and not torch.equal(first, other)
    for a, b in zip(first_grads, second_grads):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_replaced_model_keeps_state_dict_pickles_and_copies(generator):
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True)
    original = randomize(nn.TransformerEncoder(layer, LAYERS), generator).eval()
    model = fused_attn.replace_attention(copy.deepcopy(original))
    assert all(type(m) is fused_attn.modules.TransformerEncoderLayer for m in model.layers)
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in original.state_dict().items()}
    fresh = nn.TransformerEncoder(nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True), LAYERS)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), copy.deepcopy(model)]
    src, padding = source(generator, True, torch.float32), right_padding(generator)
    with torch.no_grad():
        expected = model(src, src_key_padding_mask=padding)
        for restored in copies:
            assert type(restored.layers[0]) is fused_attn.modules.TransformerEncoderLayer
            assert type(restored.layers[0].self_attn) is fused_attn.MultiheadAttention
            out, log = logged(restored, src, src_key_padding_mask=padding)
            assert_fused(log, LAYERS)
            assert torch.equal(out, expected)


def test_layer_constructed_directly_is_fused_with_nn_state_dict(generator):
    ours = fused_attn.modules.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True, backend="cpu")
    theirs = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, batch_first=True)
    assert type(ours.self_attn) is fused_attn.MultiheadAttention and ours.self_attn.backend == "cpu"
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    ours.eval(), theirs.eval()
    src = source(generator, True, torch.float32)
    with torch.no_grad():
        out, log = logged(ours, src)
        assert log.fused() == ["fused_attn.attention_fwd:cpu"]
        torch.testing.assert_close(out, theirs(src))


def test_subclassed_layer_is_kept_with_a_warning():
    class Custom(nn.TransformerEncoderLayer):
        pass

    model = nn.Sequential(Custom(EMBED, HEADS, FEEDFORWARD, batch_first=True))
    with pytest.warns(UserWarning, match="Custom subclasses nn.TransformerEncoderLayer"):
        fused_attn.replace_attention(model)
    assert type(model[0]) is Custom and type(model[0].self_attn) is fused_attn.MultiheadAttention
