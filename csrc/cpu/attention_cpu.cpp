// The CPU implementations of fused_attn::flash_forward and fused_attn::flash_backward (schemas in
// csrc/ops.cpp): every assumption of the kernels is checked here, with a message naming the
// argument, then the kernel of the best instruction set this CPU has runs (see flash_kernel.h).

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include "../block_mask_args.h"
#include "../output_memory.h"
#include "flash_params.h"

namespace fused_attn_cpu {
namespace {

Dtype dtype_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return Dtype::Float32;
    case at::kDouble:
      return Dtype::Float64;
    case at::kBFloat16:
      return Dtype::BFloat16;
    case at::kHalf:
      return Dtype::Float16;
    default:
      TORCH_CHECK(false, "query: expected dtype float32, float64, bfloat16 or float16, got ", type);
  }
}

at::ScalarType lse_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

View view_of(const at::Tensor& t) {
  View v;
  v.data = t.data_ptr();
  for (int64_t i = 0; i < t.dim(); ++i) v.s[i] = t.stride(i);
  return v;
}

void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t rank,
                  at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.defined(), op, ": ", name, ": expected a tensor, got an undefined one");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, ": expected a strided tensor, got ", t.layout());
  TORCH_CHECK(t.dim() == rank, op, ": ", name, ": expected a ", rank, "-D tensor, got shape ", t.sizes());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, ": expected shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ",
              t.scalar_type());
}

// Shapes, dtypes and devices of query, key, value and the masks; fills everything but outputs. Key and value
// are of the query's dtype, or of `cache_dtype` (an 8-bit cache's, checked by check_scales).
Params describe(const char* op, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_mask,
                const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale,
                std::optional<at::ScalarType> cache_dtype = std::nullopt) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(), op,
              ": query, key and value must be tensors");
  TORCH_CHECK(query.dim() == 4, op, ": query: expected a 4-D tensor (B, H_q, L_q, D), got shape ",
              query.sizes());
  TORCH_CHECK(key.dim() == 4, op, ": key: expected a 4-D tensor (B, H_kv, L_k, D), got shape ",
              key.sizes());
  TORCH_CHECK(value.dim() == 4, op, ": value: expected a 4-D tensor (B, H_kv, L_k, D_v), got shape ",
              value.sizes());
  Params p;
  p.dtype = dtype_of(query.scalar_type());
  p.batch = query.size(0);
  p.heads_q = query.size(1);
  p.len_q = query.size(2);
  p.dim_qk = query.size(3);
  p.heads_kv = key.size(1);
  p.len_k = key.size(2);
  p.dim_v = value.size(3);
  const auto dtype = query.scalar_type();
  check_tensor(op, "query", query, 4, query.sizes(), dtype);
  check_tensor(op, "key", key, 4, {p.batch, p.heads_kv, p.len_k, p.dim_qk}, cache_dtype.value_or(dtype));
  check_tensor(op, "value", value, 4, {p.batch, p.heads_kv, p.len_k, p.dim_v}, cache_dtype.value_or(dtype));
  TORCH_CHECK(p.heads_kv > 0 && p.heads_q % p.heads_kv == 0, op,
              ": key: expected a number of heads dividing the query's ", p.heads_q, ", got ",
              p.heads_kv);
  TORCH_CHECK(std::isfinite(scale), op, ": scale: expected a finite number, got ", scale);
  p.query = view_of(query);
  p.key = view_of(key);
  p.value = view_of(value);
  p.window_right = is_causal ? 0 : -1;
  p.scale = scale;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == dtype, op,
                ": attn_mask: expected dtype bool or ", dtype, " (as query), got ", mask.scalar_type());
    check_tensor(op, "attn_mask", mask, 4, {p.batch, p.heads_q, p.len_q, p.len_k}, mask.scalar_type());
    p.mask_kind = mask.scalar_type() == at::kBool ? MaskKind::Bool : MaskKind::Additive;
    p.mask = view_of(mask);
  }
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    check_tensor(op, "key_padding_mask", *key_padding_mask, 2, {p.batch, p.len_k}, at::kBool);
    p.key_padding = view_of(*key_padding_mask);
  }
  return p;
}

// The key padding as one range of keys per batch row (Params::key_spans), written to `spans`; the
// padding row itself stays in `p` only where a padded key lies inside its row's range.
void describe_padding_spans(Params& p, std::vector<int64_t>& spans) {
  if (p.key_padding.data == nullptr) return;
  spans.assign(2 * p.batch, 0);
  bool holes = false;
  const bool* padding = static_cast<const bool*>(p.key_padding.data);
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t first = p.len_k, end = 0, kept = 0;
    for (int64_t j = 0; j < p.len_k; ++j) {
      if (!padding[b * p.key_padding.s[0] + j * p.key_padding.s[1]]) {
        first = std::min(first, j);
        end = j + 1;
        ++kept;
      }
    }
    spans[2 * b] = first;
    spans[2 * b + 1] = std::max(first, end);
    holes = holes || kept != spans[2 * b + 1] - first;
  }
  p.key_spans = spans.data();
  if (!holes) p.key_padding.data = nullptr;
}

// The call's dropout: probability in [0, 1) and, when it is above 0, its (seed, offset, query_start,
// key_start) as an int64 CPU tensor of four elements (fused_attn/dropout.py draws it).
fused_attn::DropoutParams describe_dropout(const char* op, double dropout_p,
                                           const std::optional<at::Tensor>& dropout_rng) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p: expected a number in [0, 1), got ",
              dropout_p);
  fused_attn::DropoutParams d;
  if (dropout_p == 0.0) return d;
  TORCH_CHECK(dropout_rng.has_value() && dropout_rng->defined(), op,
              ": dropout_rng: expected the call's (seed, offset, query_start, key_start) with dropout_p > 0, "
              "got none");
  check_tensor(op, "dropout_rng", *dropout_rng, 1, {4}, at::kLong);
  const at::Tensor rng = dropout_rng->contiguous();
  const int64_t* values = rng.data_ptr<int64_t>();
  d.enabled = true;
  d.seed = static_cast<uint64_t>(values[0]);
  d.offset = static_cast<uint32_t>(static_cast<uint64_t>(values[1]));
  d.query_start = values[2];
  d.key_start = values[3];
  d.threshold = fused_attn::dropout_threshold(dropout_p);
  d.keep_scale = 1.0 / (1.0 - dropout_p);
  return d;
}

// The call's score variant (fused_attn/scores.py) on top of what `describe` set: the window's bounds
// (is_causal has made the right one 0), the diagonal, the softcap and the ALiBi slopes.
void describe_variant(const char* op, Params& p, const at::Tensor& query, int64_t window_left, int64_t window_right,
                      bool bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                      int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
                      const std::optional<at::Tensor>& block_bits) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1, op,
              ": window_left, window_right: expected -1 (unbounded) or a bound >= 0, got ", window_left, " and ",
              window_right);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, op, ": softcap: expected a finite number >= 0, got ",
              softcap);
  p.window_left = window_left;
  if (window_right != -1) p.window_right = p.window_right == -1 ? window_right : std::min(p.window_right, window_right);
  p.diagonal = (bottom_right ? p.len_k - p.len_q : 0) + diagonal_shift;
  p.softcap = softcap;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    check_tensor(op, "alibi_slopes", *alibi_slopes, 2, {p.batch, p.heads_q}, at::kFloat);
    p.alibi = view_of(*alibi_slopes);
  }
  p.program = fused_attn::block_program_of(op, block_tiles, block_bits, query, p.batch, p.heads_q, p.len_q, p.len_k);
}

// Block sizes and the product, with environment overrides for benchmarking:
// FUSED_ATTN_CPU_BLOCK_Q, FUSED_ATTN_CPU_BLOCK_K, FUSED_ATTN_CPU_BRGEMM=0.
int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0' && value > 0 && value <= 4096, name,
              ": expected an integer in [1, 4096], got '", text, "'");
  return value;
}

// at::native::cpublas::brgemm throws where oneDNN has no micro-kernel for the CPU and operand type (it
// does not fall back), so one tiny product decides, once per type, whether the products may use it.
// For bf16 (VNNI pairs) that is AMX, or AVX512-BF16 without it, where ATen's could_pack, which asks
// about AMX alone, says no.
template <typename T>
bool brgemm_usable() {
  static const bool usable = [] {
    constexpr bool vnni = !std::is_same_v<T, float>;
    try {
      // A = [[1, 2], [3, 4]] times the identity, whose VNNI layout (rows interleaved in pairs) is
      // the same four values.
      const T a[4] = {T(1.f), T(2.f), T(3.f), T(4.f)}, b[4] = {T(1.f), T(0.f), T(0.f), T(1.f)};
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      at::native::cpublas::brgemm(2, 2, 2, 2, 2, 2, false, a, b, c, vnni);
      at::native::cpublas::brgemm_release(vnni);
      return c[0] == 1.f && c[1] == 2.f && c[2] == 3.f && c[3] == 4.f;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return usable;
}

// An on/off switch of the environment: unset or empty is `fallback`.
bool env_flag(const char* name, bool fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  const std::string value = text;
  TORCH_CHECK(value == "0" || value == "1", name, ": expected 0 or 1, got '", value, "'");
  return value == "1";
}

// The L2 of one core, as the C library reports it (sysconf), or 0 where it reports none.
int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    return std::max<int64_t>(sysconf(_SC_LEVEL2_CACHE_SIZE), 0);
#else
    return int64_t{0};
#endif
  }();
  return bytes;
}

// The forward's longest key block, of 512, 256 and 128 keys, whose working set fits a core's L2: the Kᵀ and V blocks
// and the query rows in the products' operand type (2 bytes where bf16 goes to oneDNN as it is, else float's 4), the
// float scores (and the weights, where they are 16-bit), and the float output rows. At D = 128 in float, 512 keys
// make 896 KiB against Zen 3's 512 KiB, where 256 keys made the forward 10-11 % faster (bench/NOTES.md section
// 85); at 1 MiB and more every head dim up to 128 keeps 512. 512 where the L2's size is unknown.
int64_t forward_block_keys(const Params& p, int64_t block_q) {
  const int64_t l2 = l2_cache_bytes();
  if (l2 == 0) return 512;
  const int64_t operand = p.dtype == Dtype::Float64 ? 8 : (p.bf16_brgemm ? 2 : 4);
  const int64_t accumulator = p.dtype == Dtype::Float64 ? 8 : 4;
  const auto working_set = [&](int64_t keys) {
    return keys * (p.dim_qk + p.dim_v) * operand + block_q * keys * (accumulator + (operand < 4 ? operand : 0)) +
           block_q * (p.dim_qk * operand + p.dim_v * accumulator);
  };
  int64_t keys = 512;
  while (keys > 128 && working_set(keys) > l2) keys /= 2;
  return keys;
}

void choose_tiling(Params& p, bool backward) {
  // Larger query blocks amortise the packing of each key block over more rows; the forward keeps
  // a (block_q × block_k) score block per thread in L2.
  const bool program = p.program.present();
  // A narrow window's rows see few keys, and a backward query block computes from its first row's first key to
  // its last row's last: blocks of 32 rows halve that spread (bench/NOTES.md section 36; the forward cuts its
  // blocks into 32-row parts instead).
  const bool narrow_window = backward && !program && p.window_left >= 0 && p.window_right >= 0 &&
                             p.window_left + p.window_right <= 256;
  // Without a float brgemm, bf16/fp16 also compute in float with the built-in micro-kernel.
  p.use_brgemm = env_flag("FUSED_ATTN_CPU_BRGEMM", true) && p.dtype != Dtype::Float64 && brgemm_usable<float>();
  p.bf16_brgemm = p.use_brgemm && p.dtype == Dtype::BFloat16 && brgemm_usable<c10::BFloat16>();
  p.use_decode = env_flag("FUSED_ATTN_CPU_DECODE", true);
  p.block_q = env_int("FUSED_ATTN_CPU_BLOCK_Q", narrow_window ? 32 : backward || program ? 64 : 128);
  // A decode call's blocks are keys of a few rows (decode_impl), whose 512 the rule below does not measure.
  const bool decode = !backward && takes_decode_path(p);
  p.block_k = env_int("FUSED_ATTN_CPU_BLOCK_K", backward ? 256 : decode ? 512 : forward_block_keys(p, p.block_q));
  if (program) {
    // A program's tiles decide whole blocks: query blocks divide its rows; key blocks are runs of its
    // tiles' columns (a multiple of kTile: 128-key blocks cost the forward 15-19 % against 512 and the
    // backward 2-3 % against 256, bench/NOTES.md sections 30 and 31).
    p.block_q = std::gcd(p.block_q, fused_attn::kTile);
    p.block_k = std::max(fused_attn::kTile, p.block_k / fused_attn::kTile * fused_attn::kTile);
  }
  p.poison_scratch = env_flag("FUSED_ATTN_CPU_POISON_SCRATCH", false);
}

// The kernels for the best instruction set of this CPU, as ATen judges it (at::get_cpu_capability()
// honours ATEN_CPU_CAPABILITY), plus AVX512-BF16 where the CPU has it. FUSED_ATTN_CPU_ISA (default,
// avx2, avx512, avx512_bf16) forces one, for tests; it must not exceed what the CPU runs.
std::string chosen_isa() {
  std::string isa = at::get_cpu_capability();
#if defined(__x86_64__) || defined(_M_X64)
  const bool has_bf16 = isa == "AVX512" && __builtin_cpu_supports("avx512bf16");
  if (has_bf16) isa = "AVX512_BF16";
  if (const char* forced = std::getenv("FUSED_ATTN_CPU_ISA"); forced != nullptr && *forced != '\0') {
    const std::string name = forced;
    const std::vector<std::string> order = {"default", "avx2", "avx512", "avx512_bf16"};
    std::string best = isa;
    std::transform(best.begin(), best.end(), best.begin(), ::tolower);
    const auto wanted = std::find(order.begin(), order.end(), name);
    TORCH_CHECK(wanted != order.end() && wanted <= std::find(order.begin(), order.end(), best),
                "FUSED_ATTN_CPU_ISA: expected one of default, avx2, avx512, avx512_bf16 up to ", best,
                " on this CPU, got '", name, "'");
    isa = name;
    std::transform(isa.begin(), isa.end(), isa.begin(), ::toupper);
  }
  return isa;
#else
  return "DEFAULT";
#endif
}

void run(const Params& p, bool backward) {
  const std::string isa = chosen_isa();
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "AVX512_BF16") {
    backward ? AVX512_BF16::backward(p) : AVX512_BF16::forward(p);
    return;
  }
  if (isa == "AVX512") {
    backward ? AVX512::backward(p) : AVX512::forward(p);
    return;
  }
  if (isa == "AVX2") {
    backward ? AVX2::backward(p) : AVX2::forward(p);
    return;
  }
#endif
  backward ? DEFAULT::backward(p) : DEFAULT::forward(p);
}

// What a forward call of `dtype` runs now (environment included): the kernels' instruction-set copy and
// what computes its products, e.g. "AVX512_BF16; oneDNN brgemm on bf16 operands (AVX512-BF16, no AMX)".
// Said of long queries: decode calls of a few rows may compute in float (typed_products).
std::string cpu_kernels(at::ScalarType dtype) {
  Params p;
  p.dtype = dtype_of(dtype);
  choose_tiling(p, false);
  const std::string isa = chosen_isa();
  const char* products = DEFAULT::products(p);
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "AVX512_BF16") products = AVX512_BF16::products(p);
  if (isa == "AVX512") products = AVX512::products(p);
  if (isa == "AVX2") products = AVX2::products(p);
#endif
  return isa + "; " + products;
}

// The blocks and block table of a paged cache (paged_forward); undefined tensors for a dense one. An 8-bit
// cache has its scales (check_scales); undefined for one of the query's dtype.
struct PagedCache {
  at::Tensor k_blocks, v_blocks, block_table;
  at::Tensor k_scale, v_scale;
};

// Reads key and value through the cache's block table when `paged` has one.
void describe_pages(Params& p, const PagedCache& paged) {
  if (!paged.block_table.defined()) return;
  const auto blocks_view = [](const at::Tensor& blocks) {  // (num_blocks, H_kv, block_size, D)
    View v;
    v.data = blocks.data_ptr();
    v.s[0] = blocks.stride(0);
    v.s[1] = blocks.stride(2);
    v.s[2] = blocks.stride(1);
    v.s[3] = blocks.stride(3);
    return v;
  };
  p.key = blocks_view(paged.k_blocks);
  p.value = blocks_view(paged.v_blocks);
  p.pages = paged.block_table.data_ptr<int32_t>();
  p.pages_stride = paged.block_table.stride(0);
  p.page_size = paged.k_blocks.size(1);
  if (!paged.k_scale.defined()) return;
  p.cache = paged.k_blocks.scalar_type() == at::kFloat8_e4m3fn ? CacheType::Float8E4M3 : CacheType::Int8;
  p.token_scales = paged.k_scale.dim() == 3;
  const auto scales_view = [&](const at::Tensor& scales) {  // (num_blocks or B, H_kv, block_size or none)
    View v;
    v.data = scales.data_ptr();
    v.s[0] = scales.stride(0);
    v.s[1] = p.token_scales ? scales.stride(2) : scales.stride(1);
    v.s[2] = p.token_scales ? scales.stride(1) : 0;
    return v;
  };
  p.k_scale = scales_view(paged.k_scale);
  p.v_scale = scales_view(paged.v_scale);
}

// An 8-bit cache's blocks and scales (paged_forward): float8_e4m3fn or int8 blocks, both alike, with float32
// k_scale and v_scale, both (B, H_kv) (per sequence and head) or both (num_blocks, block_size, H_kv) (per stored
// key and head), any strides, under a query of float32, bfloat16 or float16. Without scales, the blocks are of
// the query's dtype (describe checks it).
void check_scales(const char* op, const at::Tensor& query, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                  const at::Tensor& block_table, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const auto type = k_blocks.scalar_type();
  const bool eight_bit = type == at::kFloat8_e4m3fn || type == at::kChar;
  if (!k_scale.defined() && !v_scale.defined()) {
    TORCH_CHECK(!eight_bit, op, ": k_scale: expected the float32 scales of the ", type, " cache, got none");
    return;
  }
  TORCH_CHECK(k_scale.defined() && v_scale.defined(), op, ": ", k_scale.defined() ? "v_scale" : "k_scale",
              ": expected scales for key and value alike, got them for one of them only");
  TORCH_CHECK(eight_bit, op, ": k_blocks: expected dtype float8_e4m3fn or int8 with k_scale and v_scale, got ", type);
  TORCH_CHECK(v_blocks.scalar_type() == type, op, ": v_blocks: expected k_blocks' dtype ", type, ", got ",
              v_blocks.scalar_type());
  const auto query_type = query.scalar_type();
  TORCH_CHECK(query_type == at::kFloat || query_type == at::kBFloat16 || query_type == at::kHalf, op,
              ": query: expected dtype float32, bfloat16 or float16 over an 8-bit cache, got ", query_type);
  const std::vector<int64_t> per_sequence = {block_table.size(0), k_blocks.size(2)};
  const std::vector<int64_t> per_token = k_blocks.sizes().slice(0, 3).vec();
  for (const auto& [name, scales] : {std::pair<const char*, const at::Tensor&>{"k_scale", k_scale},
                                     std::pair<const char*, const at::Tensor&>{"v_scale", v_scale}}) {
    TORCH_CHECK(scales.device().is_cpu() && scales.layout() == at::kStrided, op, ": ", name,
                ": expected a strided CPU tensor, got ", scales.layout(), " on ", scales.device());
    TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": ", name, ": expected dtype float32, got ",
                scales.scalar_type());
    TORCH_CHECK(scales.sizes() == at::IntArrayRef(per_sequence) || scales.sizes() == at::IntArrayRef(per_token), op,
                ": ", name, ": expected shape (B, H_kv) = ", at::IntArrayRef(per_sequence),
                " (per sequence) or (num_blocks, block_size, H_kv) = ", at::IntArrayRef(per_token),
                " (per token), got ", scales.sizes());
  }
  TORCH_CHECK(k_scale.dim() == v_scale.dim(), op, ": v_scale: expected k_scale's layout (per ",
              k_scale.dim() == 3 ? "token" : "sequence", "), got shape ", v_scale.sizes());
}

// The blocks each batch row visits, [0, ⌈end of its key span / block_size⌉), must index the cache (none for a row
// whose padding hides every key).
void check_pages(const char* op, const Params& p, const at::Tensor& block_table, int64_t num_blocks) {
  if (p.pages == nullptr) return;
  TORCH_CHECK(block_table.size(1) == 0 || block_table.stride(1) == 1, op,
              ": block_table: expected unit stride along its blocks, got strides ", block_table.strides());
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t end = p.len_k;
    if (p.key_spans != nullptr) end = p.key_spans[2 * b] < p.key_spans[2 * b + 1] ? p.key_spans[2 * b + 1] : 0;
    for (int64_t i = 0; i * p.page_size < end; ++i) {
      const int64_t block = p.pages[b * p.pages_stride + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, op, ": block_table: entry (", b, ", ", i, ") = ", block,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

// flash_forward, reading key and value through `paged`'s block table when it has one (paged_forward).
at::Tensor forward_of(const char* op, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
                      bool is_causal, double scale, const at::Tensor& out, double dropout_p,
                      const std::optional<at::Tensor>& dropout_rng, int64_t window_left, int64_t window_right,
                      bool bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                      int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
                      const std::optional<at::Tensor>& block_bits, const std::optional<at::Tensor>& sinks,
                      const PagedCache& paged) {
  Params p = describe(op, query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                      paged.k_scale.defined() ? std::optional(paged.k_blocks.scalar_type()) : std::nullopt);
  describe_pages(p, paged);
  p.dropout = describe_dropout(op, dropout_p, dropout_rng);
  describe_variant(op, p, query, window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
                   block_tiles, block_bits);
  TORCH_CHECK(!p.program.present() || p.pages == nullptr, op,
              ": block_tiles: a mask program is not taken with a paged cache");
  if (sinks.has_value() && sinks->defined()) {
    check_tensor(op, "sinks", *sinks, 1, {p.heads_q}, lse_dtype(query.scalar_type()));
    TORCH_CHECK(sinks->is_contiguous(), op, ": sinks: expected a contiguous tensor, got strides ", sinks->strides());
    p.sinks = sinks->data_ptr();
  }
  std::vector<int64_t> spans;
  describe_padding_spans(p, spans);
  check_pages(op, p, paged.block_table, paged.k_blocks.size(0));
  check_tensor(op, "out", out, 4, {p.batch, p.heads_q, p.len_q, p.dim_v}, query.scalar_type());
  const at::Tensor& key_memory = p.pages ? paged.k_blocks : key;
  const at::Tensor& value_memory = p.pages ? paged.v_blocks : value;
  fused_attn::check_output_memory(op, "out", out, {{"query", &query}, {"key", &key_memory}, {"value", &value_memory},
                                                  {"k_scale", &paged.k_scale}, {"v_scale", &paged.v_scale}});
  p.out = view_of(out);
  at::Tensor lse = at::empty({p.batch, p.heads_q, p.len_q}, query.options().dtype(lse_dtype(query.scalar_type())));
  p.lse = view_of(lse);
  choose_tiling(p, false);
  if (out.numel() == 0 && lse.numel() == 0) return lse;
  run(p, false);
  return lse;
}

at::Tensor flash_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask,
                         const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                         double scale, const at::Tensor& out, double dropout_p,
                         const std::optional<at::Tensor>& dropout_rng, int64_t window_left, int64_t window_right,
                         bool bottom_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                         int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
                         const std::optional<at::Tensor>& block_bits, const std::optional<at::Tensor>& sinks) {
  return forward_of("flash_forward", query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout_p,
                    dropout_rng, window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
                    block_tiles, block_bits, sinks, {});
}

// The (B, H_kv, max_blocks · block_size, D) tensor a paged cache (num_blocks, block_size, H_kv, D) stands for,
// for the checks of shape, dtype and device: the kernels read its elements through the block table.
at::Tensor logical_cache(const char* op, const char* name, const at::Tensor& blocks, const at::Tensor& block_table) {
  TORCH_CHECK(blocks.dim() == 4, op, ": ", name, ": expected a 4-D tensor (num_blocks, block_size, H_kv, D), got shape ",
              blocks.sizes());
  TORCH_CHECK(blocks.size(1) > 0, op, ": ", name, ": expected blocks of at least one key, got shape ", blocks.sizes());
  return blocks.as_strided({block_table.size(0), blocks.size(2), block_table.size(1) * blocks.size(1), blocks.size(3)},
                           {0, blocks.stride(2), 0, blocks.stride(3)});
}

// flash_forward over a paged key/value cache: key j of sequence b is row j % block_size of block
// block_table[b, j / block_size] of k_blocks (and of v_blocks for its value). Every block that holds a
// key the call visits must be a valid index; the others are never read. With k_scale and v_scale, an 8-bit
// cache (check_scales), whose keys and values are dequantized where the kernels load them.
at::Tensor paged_forward(const at::Tensor& query, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                         const at::Tensor& block_table, const std::optional<at::Tensor>& attn_mask,
                         const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale,
                         const at::Tensor& out, int64_t window_left, int64_t window_right, bool bottom_right,
                         double softcap, const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
                         const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits,
                         const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_forward";
  TORCH_CHECK(block_table.dim() == 2, op, ": block_table: expected a 2-D tensor (B, max_blocks), got shape ",
              block_table.sizes());
  check_tensor(op, "block_table", block_table, 2, block_table.sizes(), at::kInt);
  TORCH_CHECK(v_blocks.dim() == 4 && v_blocks.sizes().slice(0, 3) == k_blocks.sizes().slice(0, 3), op,
              ": v_blocks: expected the blocks (num_blocks, block_size, H_kv) of k_blocks ", k_blocks.sizes().slice(0, 3),
              ", got shape ", v_blocks.sizes());
  const at::Tensor key = logical_cache(op, "k_blocks", k_blocks, block_table);
  const at::Tensor value = logical_cache(op, "v_blocks", v_blocks, block_table);
  const at::Tensor k_scales = k_scale.value_or(at::Tensor()), v_scales = v_scale.value_or(at::Tensor());
  check_scales(op, query, k_blocks, v_blocks, block_table, k_scales, v_scales);
  return forward_of(op, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, 0.0, std::nullopt,
                    window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                    block_bits, sinks, PagedCache{k_blocks, v_blocks, block_table, k_scales, v_scales});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, double dropout_p,
    const std::optional<at::Tensor>& dropout_rng, const std::optional<at::Tensor>& grad_mask,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
    const std::optional<at::Tensor>& block_bits) {
  const char* op = "flash_backward";
  Params p = describe(op, query, key, value, attn_mask, key_padding_mask, is_causal, scale);
  p.dropout = describe_dropout(op, dropout_p, dropout_rng);
  describe_variant(op, p, query, window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
                   block_tiles, block_bits);
  std::vector<int64_t> spans;
  describe_padding_spans(p, spans);
  const auto dtype = query.scalar_type();
  const auto stat_dtype = lse_dtype(dtype);
  check_tensor(op, "out", out, 4, {p.batch, p.heads_q, p.len_q, p.dim_v}, dtype);
  check_tensor(op, "grad_out", grad_out, 4, {p.batch, p.heads_q, p.len_q, p.dim_v}, dtype);
  check_tensor(op, "lse", lse, 3, {p.batch, p.heads_q, p.len_q}, stat_dtype);
  p.out = view_of(out);
  p.grad_out = view_of(grad_out);
  p.lse = view_of(lse);
  if (grad_lse.has_value() && grad_lse->defined()) {
    check_tensor(op, "grad_lse", *grad_lse, 3, {p.batch, p.heads_q, p.len_q}, stat_dtype);
    p.grad_lse = view_of(*grad_lse);
  }
  if (grad_mask.has_value() && grad_mask->defined()) {
    TORCH_CHECK(p.mask_kind == MaskKind::Additive, op,
                ": grad_mask: expected only with an additive (floating) attn_mask");
    check_tensor(op, "grad_mask", *grad_mask, 4, {p.batch, p.heads_q, p.len_q, p.len_k}, dtype);
    TORCH_CHECK(grad_mask->is_contiguous(), op, ": grad_mask: expected a contiguous tensor");
    fused_attn::check_output_memory(op, "grad_mask", *grad_mask,
                                    {{"query", &query}, {"key", &key}, {"value", &value},
                                     {"attn_mask", &*attn_mask}, {"grad_out", &grad_out}});
    p.grad_mask = view_of(*grad_mask);
  }
  // Laid out like the inputs where they are dense (empty_like's rule, which the fake kernel in
  // fused_attn/ops.py follows too), contiguous otherwise. Where scratch is poisoned (the tests), NaN until
  // written: an element the kernel missed shows in every test instead of stale memory. Elsewhere not filled:
  // the fill is a pass over O(L·D) memory, 11 % of the backward of a narrow window (bench/NOTES.md section 43).
  const bool poison = env_flag("FUSED_ATTN_CPU_POISON_SCRATCH", false);
  const auto gradient_like = [poison](const at::Tensor& input) {
    return poison ? at::full_like(input, std::numeric_limits<double>::quiet_NaN()) : at::empty_like(input);
  };
  at::Tensor grad_query = gradient_like(query);
  at::Tensor grad_key = gradient_like(key);
  at::Tensor grad_value = gradient_like(value);
  at::Tensor delta = at::empty({p.batch, p.heads_q, p.len_q}, query.options().dtype(stat_dtype));
  p.grad_query = view_of(grad_query);
  p.grad_key = view_of(grad_key);
  p.grad_value = view_of(grad_value);
  p.delta = view_of(delta);
  choose_tiling(p, true);
  if (grad_query.numel() == 0 && grad_key.numel() == 0 && grad_value.numel() == 0) {
    return {grad_query, grad_key, grad_value};
  }
  run(p, true);
  return {grad_query, grad_key, grad_value};
}

}  // namespace
}  // namespace fused_attn_cpu

// A question about this build and CPU, not a computation on tensors: defined beside its only
// implementation rather than with the kernels' schemas in csrc/ops.cpp.
TORCH_LIBRARY_FRAGMENT(fused_attn, m) {
  m.def("cpu_kernels(ScalarType dtype) -> str", &fused_attn_cpu::cpu_kernels);
}

TORCH_LIBRARY_IMPL(fused_attn, CPU, m) {
  m.impl("flash_forward", &fused_attn_cpu::flash_forward);
  m.impl("flash_backward", &fused_attn_cpu::flash_backward);
  m.impl("paged_forward", &fused_attn_cpu::paged_forward);
}
