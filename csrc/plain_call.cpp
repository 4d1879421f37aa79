// The direct entry of plain calls (fused_attn/plans.py): `fused_attn._C.plain_forward`, a CPython
// function that allocates the output and calls fused_attn::flash_forward through the dispatcher from
// C++. A small call through `torch.ops` spends microseconds turning sixteen Python arguments into
// IValues (bench/NOTES.md, section 27); a plain call has five that vary and no mask, padding, dropout
// or ALiBi, and the plan has already made every check the Python path makes.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>

namespace {

using FlashForward = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double,
                                const at::Tensor&, double, const std::optional<at::Tensor>&, int64_t, int64_t, bool,
                                double, const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

const at::Tensor& tensor_argument(PyObject* object, const char* name) {
  TORCH_CHECK_TYPE(THPVariable_Check(object), "plain_forward: ", name, ": expected a torch.Tensor");
  return THPVariable_Unpack(object);
}

// plain_forward(query, key, value, is_causal, scale, window_left, window_right, bottom_right, softcap,
// diagonal_shift) -> (out, lse): the output laid out as fused_attn/problem.py's output_like (B, L_q, H_q,
// D_v in memory), the forward run without the GIL.
PyObject* plain_forward(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *query_object, *key_object, *value_object;
  int is_causal, bottom_right;
  double scale, softcap;
  long long window_left, window_right, diagonal_shift;
  if (!PyArg_ParseTuple(args, "OOOpdLLpdL", &query_object, &key_object, &value_object, &is_causal, &scale,
                        &window_left, &window_right, &bottom_right, &softcap, &diagonal_shift)) {
    return nullptr;
  }
  const at::Tensor& query = tensor_argument(query_object, "query");
  const at::Tensor& key = tensor_argument(key_object, "key");
  const at::Tensor& value = tensor_argument(value_object, "value");
  TORCH_CHECK(query.dim() == 4 && value.dim() == 4, "plain_forward: expected 4-D query and value");
  const int64_t batch = query.size(0), heads = query.size(1), length = query.size(2), dim_v = value.size(3);
  at::Tensor out = at::empty_strided({batch, heads, length, dim_v}, {length * heads * dim_v, dim_v, heads * dim_v, 1},
                                     query.options());
  static const auto forward = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("fused_attn::flash_forward", "")
                                  .typed<FlashForward>();
  at::Tensor lse;
  Py_BEGIN_ALLOW_THREADS
  lse = forward.call(query, key, value, std::nullopt, std::nullopt, is_causal != 0, scale, out, 0.0, std::nullopt,
                     window_left, window_right, bottom_right != 0, softcap, std::nullopt, diagonal_shift,
                     std::nullopt, std::nullopt, std::nullopt);
  Py_END_ALLOW_THREADS
  PyObject* result = PyTuple_New(2);
  if (result == nullptr) return nullptr;
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(out)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(lse)));
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace

// The methods of the fused_attn._C module (csrc/ops.cpp defines the module).
PyMethodDef fused_attn_module_methods[] = {
    {"plain_forward", plain_forward, METH_VARARGS,
     "plain_forward(query, key, value, is_causal, scale, window_left, window_right, bottom_right, softcap, "
     "diagonal_shift) -> (out, lse): fused_attn::flash_forward without mask, padding, dropout or ALiBi, into a "
     "new output laid out as fused_attn.problem.output_like"},
    {nullptr, nullptr, 0, nullptr}};
