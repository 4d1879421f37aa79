// The schemas of the C++ kernels, defined once. Each device registers its implementation in its own
// file (csrc/cpu, csrc/cuda) with TORCH_LIBRARY_IMPL; Python wraps them in fused_attn/ops.py.
//
// Tensors follow fused_attn/problem.py: query (B, H_q, L_q, D_qk), key (B, H_kv, L_k, D_qk),
// value (B, H_kv, L_k, D_v), any strides; attn_mask a bool or additive view of (B, H_q, L_q, L_k)
// with stride 0 where it broadcasts; key_padding_mask bool (B, L_k), true = ignore; `out`
// (B, H_q, L_q, D_v) written in place. The forward returns the log-sum-exp (B, H_q, L_q).
// Dropout (dropout_p > 0) drops the elements of csrc/dropout.h's stream for the call's (seed, offset,
// query_start, key_start), dropout_rng: int64 (4,) on the tensors' device. The backward writes the gradient of an additive
// attn_mask, dS, into `grad_mask` when given: zeros (B, H_q, L_q, L_k) of the mask's dtype, dense.
// The score variant (fused_attn/scores.py): query i sees key j iff -window_left <= j - (i + offset)
// <= window_right (-1: unbounded; is_causal makes window_right 0), offset = (L_k - L_q if bottom_right
// else 0) + diagonal_shift; softcap > 0 caps the scaled scores; alibi_slopes, float32 (B, H_q) with any strides, adds
// -slope * |i + offset - j|. sinks, (H_q,) contiguous, of the lse's dtype (forward ops only): one logit per query head
// that joins every row's softmax and carries no value, so lse_i = log(exp(sinks[h]) + sum_j exp(s_ij)) and
// out_i = sum_j exp(s_ij - lse_i) v_j; a row that sees no key gives 0 and lse sinks[h]. The backward
// needs no sinks: the lse it is given includes them. block_tiles and block_bits, both or neither, are a mask
// program (csrc/block_mask.h): its tile states (B, H_q, ⌈L_q/128⌉, ⌈L_k/128⌉) and its partial tiles' bits; what it
// hides adds to what the rest of the call hides. The varlen ops do not take one yet.

#include <Python.h>
#include <torch/library.h>

extern PyMethodDef fused_attn_module_methods[];  // csrc/plain_call.cpp

#define FUSED_ATTN_STRINGIFY_(...) #__VA_ARGS__
#define FUSED_ATTN_STRINGIFY(...) FUSED_ATTN_STRINGIFY_(__VA_ARGS__)

extern "C" {
// `import fused_attn._C` loads this library, which registers the ops below as a side effect.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, fused_attn_module_methods};
  PyObject* module = PyModule_Create(&module_def);
#ifdef FUSED_ATTN_CUDA_ARCHITECTURES
  // What nvcc built the CUDA kernels for (setup.py: sm_XY cubins, compute_XY PTX), which the cuda backend
  // compares with a device's compute capability.
  if (module != nullptr &&
      PyModule_AddStringConstant(module, "cuda_architectures",
                                 FUSED_ATTN_STRINGIFY(FUSED_ATTN_CUDA_ARCHITECTURES)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
#endif
  return module;
}
}

TORCH_LIBRARY(fused_attn, m) {
  m.def(
      "flash_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor? key_padding_mask, bool is_causal, float scale, Tensor(a!) out, float dropout_p=0., "
      "Tensor? dropout_rng=None, int window_left=-1, int window_right=-1, bool bottom_right=False, "
      "float softcap=0., Tensor? alibi_slopes=None, int diagonal_shift=0, Tensor? block_tiles=None, "
      "Tensor? block_bits=None, Tensor? sinks=None) -> Tensor");
  m.def(
      "flash_backward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor? key_padding_mask, bool is_causal, float scale, Tensor out, Tensor lse, "
      "Tensor grad_out, Tensor? grad_lse, float dropout_p=0., Tensor? dropout_rng=None, "
      "Tensor(b!)? grad_mask=None, int window_left=-1, int window_right=-1, bool bottom_right=False, "
      "float softcap=0., Tensor? alibi_slopes=None, int diagonal_shift=0, Tensor? block_tiles=None, "
      "Tensor? block_bits=None) -> (Tensor, Tensor, Tensor)");
  // The forward over a paged key/value cache (CPU): key and value are blocks (num_blocks, block_size,
  // H_kv, D), any strides, and key j of sequence b lies in block block_table[b, j / block_size] (int32
  // (B, max_blocks)), at row j % block_size; the call's L_k is max_blocks * block_size, and blocks past
  // each sequence's key padding are never read. No dropout, no backward (inference). k_scale and v_scale, both
  // or neither, make it an 8-bit cache (fused_attn/quantization.py): float8_e4m3fn or int8 blocks, key j standing
  // for its values times its float32 scale, the scales either (B, H_kv), per sequence and head, or (num_blocks,
  // block_size, H_kv), per stored key and head, any strides; the query float32, bfloat16 or float16.
  m.def(
      "paged_forward(Tensor query, Tensor k_blocks, Tensor v_blocks, Tensor block_table, Tensor? attn_mask, "
      "Tensor? key_padding_mask, bool is_causal, float scale, Tensor(a!) out, int window_left=-1, "
      "int window_right=-1, bool bottom_right=False, float softcap=0., Tensor? alibi_slopes=None, int diagonal_shift=0, "
      "Tensor? block_tiles=None, Tensor? block_bits=None, Tensor? sinks=None, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> Tensor");
  // A packed batch (fused_attn/varlen.py; CUDA): query (total_q, H_q, D_qk), key (total_k, H_kv, D_qk),
  // value (total_k, H_kv, D_v), any strides; sequence b is tokens cu_seqlens[b] .. cu_seqlens[b + 1]
  // (int32 or int64 (B + 1,), on the tensors' device); max_seqlen_* the longest sequences, -1 if not
  // given; alibi_slopes (B, H_q). The forward writes out (total_q, H_q, D_v) and lse (H_q, total_q),
  // float32; sequence b drops what a one-sequence call with (seed, offset + b) drops.
  m.def(
      "flash_forward_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool is_causal, float scale, Tensor(a!) out, Tensor(b!) lse, "
      "float dropout_p=0., Tensor? dropout_rng=None, int window_left=-1, int window_right=-1, "
      "bool bottom_right=False, float softcap=0., Tensor? alibi_slopes=None, int diagonal_shift=0, "
      "Tensor? block_tiles=None, Tensor? block_bits=None, Tensor? sinks=None) -> ()");
  m.def(
      "flash_backward_varlen(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool is_causal, float scale, Tensor out, Tensor lse, Tensor grad_out, "
      "Tensor? grad_lse, float dropout_p=0., Tensor? dropout_rng=None, int window_left=-1, int window_right=-1, "
      "bool bottom_right=False, float softcap=0., Tensor? alibi_slopes=None, int diagonal_shift=0, Tensor? block_tiles=None, "
      "Tensor? block_bits=None) -> (Tensor, Tensor, Tensor)");
  // rowsum(a * b) over the last dimension (CPU): float32, float64 for float64 inputs; a and b of one shape
  // and dtype, any strides. The per-row term of the sinks' gradient (fused_attn/scores.py).
  m.def("row_dots(Tensor a, Tensor b) -> Tensor");
}
