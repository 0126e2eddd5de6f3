// GEMM through oneDNN's matmul. oneDNN picks the kernel at run time from the CPU it finds: AMX
// tiles where the CPU has them, AVX-512 BF16 dot products otherwise, FP32 FMA for FP32.
// Strided memory descriptors express the transposes, so no operand is ever copied, except on a
// CPU where oneDNN has no BF16 matmul at all (below AVX-512, e.g. AVX2 only): there BF16
// operands are widened to FP32 (see run_widened).
#include <cstring>
#include <exception>
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <vector>
#include <stdexcept>
#include <tuple>

#include <dnnl.hpp>
#include <omp.h>
#include <fmt/format.h>

#include "epx/kernels/kernels.hpp"

namespace epx {
namespace {

using dt = dnnl::memory::data_type;

dt to_dnnl(DType d) {
  switch (d) {
    case DType::F32: return dt::f32;
    case DType::BF16: return dt::bf16;
    default: throw std::invalid_argument("gemm: only F32 and BF16 operands");
  }
}

// One engine; a stream per thread, since grouped GEMMs run groups on several threads at once.
struct Engine {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
};
Engine& engine() {
  static Engine e;
  return e;
}
dnnl::stream& thread_stream() {
  thread_local dnnl::stream s{engine().engine};
  return s;
}

// The logical [rows, cols] of op(X) for X stored row-major [r, c].
dnnl::memory::desc op_desc(std::int64_t r, std::int64_t c, DType d, Trans t) {
  if (t == Trans::N) return dnnl::memory::desc({r, c}, to_dnnl(d), {c, 1});
  return dnnl::memory::desc({c, r}, to_dnnl(d), {1, c});
}
// op(X) with its dimensions and leading dimension given at execution, the layout (row-major, or
// transposed) fixed: with runtime strides as well oneDNN 2.6 falls back to its reference kernel.
dnnl::memory::desc runtime_desc(DType d, Trans t) {
  constexpr dnnl::memory::dim r = DNNL_RUNTIME_DIM_VAL;
  return dnnl::memory::desc({r, r}, to_dnnl(d), t == Trans::N ? dnnl::memory::dims{r, 1} : dnnl::memory::dims{1, r});
}

// Primitive creation costs 5-300 us; a per-thread cache keyed by the problem makes a repeated
// shape (weights, fixed token counts) cost a map lookup. The experts' GEMMs (grouped_gemm) see a
// new token count per expert nearly every micro-batch when dropless: with fixed shapes that was
// a new primitive, JIT-compiled, 100-300 times an iteration on the proxy (about a tenth of its
// step). Those GEMMs use one primitive per transpose and dtype with every dimension given at run
// time (oneDNN's gemm-based matmul), shape = 0 in the key; where oneDNN has only its reference
// kernel for that (hundreds of times slower), they fall back to fixed shapes.
using Key = std::tuple<bool, std::int64_t, std::int64_t, std::int64_t, int, int, int, int, int, bool>;
constexpr std::size_t kMaxCached = 4096;

dnnl::matmul& primitive(const MatRef& a, Trans ta, const MatRef& b, Trans tb, const MatMut& c,
                        bool accumulate, std::int64_t n, bool runtime_shape) {
  thread_local std::map<Key, dnnl::matmul> cache;
  thread_local std::set<Key> reference_only;  // runtime-shape keys oneDNN has only `ref` for
  // A fixed shape: (a.rows, a.cols, ta) fix M, K and A's strides, n and tb fix B's. A run-time
  // shape: only the transposes and dtypes.
  const Key key{runtime_shape, runtime_shape ? 0 : a.rows, runtime_shape ? 0 : a.cols, runtime_shape ? 0 : n,
                static_cast<int>(a.dtype), static_cast<int>(b.dtype), static_cast<int>(c.dtype),
                static_cast<int>(ta), static_cast<int>(tb), accumulate};
  if (runtime_shape && reference_only.count(key)) return primitive(a, ta, b, tb, c, accumulate, n, false);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= kMaxCached) cache.clear();
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.f);
    attr.set_post_ops(ops);
  }
  const auto md_a = runtime_shape ? runtime_desc(a.dtype, ta) : op_desc(a.rows, a.cols, a.dtype, ta);
  const auto md_b = runtime_shape ? runtime_desc(b.dtype, tb) : op_desc(b.rows, b.cols, b.dtype, tb);
  const dnnl::memory::desc md_c = runtime_shape ? runtime_desc(c.dtype, Trans::N)
                                                : dnnl::memory::desc({c.rows, c.cols}, to_dnnl(c.dtype), {c.cols, 1});
  if (runtime_shape) {
    std::optional<dnnl::matmul::primitive_desc> pd;
    try {
      pd.emplace(dnnl::matmul::desc(md_a, md_b, md_c), attr, engine().engine);
    } catch (const dnnl::error&) {  // no implementation takes run-time shapes here
    }
    if (!pd || std::string_view(pd->impl_info_str()).starts_with("ref")) {
      reference_only.insert(key);
      return primitive(a, ta, b, tb, c, accumulate, n, false);
    }
    return cache.emplace(key, dnnl::matmul(*pd)).first->second;
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md_a, md_b, md_c), attr, engine().engine);
  return cache.emplace(key, dnnl::matmul(pd)).first->second;
}

// Whether oneDNN has a BF16 matmul on this CPU: 2.6 has one (even its reference kernel) only from
// avx512_core up, and refuses the primitive below that. Asked once, of oneDNN itself, so that
// DNNL_MAX_CPU_ISA=AVX2 takes the fallback on any machine.
bool native_bf16() {
  static const bool ok = [] {
    try {
      const auto md = op_desc(16, 16, DType::BF16, Trans::N);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md, md, md), engine().engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

void run(const MatRef& a, Trans ta, const MatRef& b, Trans tb, const MatMut& c, bool accumulate,
         bool runtime_shape = false);

// out[i] = f(i) for i < n, split over the cores only where that pays: a parallel region costs
// microseconds even with one thread, and the grouped GEMM's experts already run on all of them.
template <class F>
void convert(std::int64_t n, F f) {
  if (n < (1 << 16) || omp_in_parallel()) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

// A BF16 GEMM where oneDNN has none: A and B widened to FP32 (exact), an FP32 GEMM, and C rounded
// to BF16 once at the end (after the accumulation, as oneDNN's sum post-op does). The same
// arithmetic as a BF16 kernel with FP32 accumulation. The widened copies live per thread and
// keep the size of the largest GEMM so far (outside the tensors' memory accounting).
void run_widened(const MatRef& a, Trans ta, const MatRef& b, Trans tb, const MatMut& c, bool accumulate,
                 bool runtime_shape) {
  thread_local std::vector<float> wa, wb, wc;
  auto widen = [](const void* data, std::int64_t n, std::vector<float>& out) {
    const auto* p = static_cast<const std::uint16_t*>(data);
    out.resize(static_cast<std::size_t>(n));
    float* o = out.data();
    convert(n, [&](std::int64_t i) { o[i] = bf16_to_float(p[i]); });
    return out.data();
  };
  const MatRef fa{widen(a.data, a.rows * a.cols, wa), DType::F32, a.rows, a.cols};
  const MatRef fb{widen(b.data, b.rows * b.cols, wb), DType::F32, b.rows, b.cols};
  if (c.dtype == DType::F32) return run(fa, ta, fb, tb, c, accumulate, runtime_shape);
  const std::int64_t n = c.rows * c.cols;
  if (accumulate) widen(c.data, n, wc);
  else wc.resize(static_cast<std::size_t>(n));
  run(fa, ta, fb, tb, {wc.data(), DType::F32, c.rows, c.cols}, accumulate, runtime_shape);
  auto* out = static_cast<std::uint16_t*>(c.data);
  const float* w = wc.data();
  convert(n, [&](std::int64_t i) { out[i] = float_to_bf16(w[i]); });
}

void run(const MatRef& a, Trans ta, const MatRef& b, Trans tb, const MatMut& c, bool accumulate,
         bool runtime_shape) {
  const std::int64_t m = ta == Trans::N ? a.rows : a.cols;
  const std::int64_t k = ta == Trans::N ? a.cols : a.rows;
  const std::int64_t kb = tb == Trans::N ? b.rows : b.cols;
  const std::int64_t n = tb == Trans::N ? b.cols : b.rows;
  if (k != kb || c.rows != m || c.cols != n || a.dtype != b.dtype)
    throw std::invalid_argument(fmt::format(
        "gemm: op(A) is [{}, {}] {}, op(B) is [{}, {}] {}, C is [{}, {}]: shapes or dtypes do not "
        "match", m, k, dtype_name(a.dtype), kb, n, dtype_name(b.dtype), c.rows, c.cols));
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) std::memset(c.data, 0, static_cast<std::size_t>(m * n) * dtype_size(c.dtype));
    return;
  }
  if (a.dtype == DType::BF16 && !native_bf16()) return run_widened(a, ta, b, tb, c, accumulate, runtime_shape);
  auto& e = engine();
  auto& mm = primitive(a, ta, b, tb, c, accumulate, n, runtime_shape);
  const auto md_a = op_desc(a.rows, a.cols, a.dtype, ta);
  const auto md_b = op_desc(b.rows, b.cols, b.dtype, tb);
  const dnnl::memory::desc md_c({c.rows, c.cols}, to_dnnl(c.dtype), {c.cols, 1});
  dnnl::memory ma(md_a, e.engine, const_cast<void*>(a.data));
  dnnl::memory mb(md_b, e.engine, const_cast<void*>(b.data));
  dnnl::memory mc(md_c, e.engine, c.data);
  dnnl::stream& stream = thread_stream();
  mm.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  stream.wait();
}

}  // namespace

MatRef mat(const Tensor& t, std::int64_t row0, std::int64_t n) {
  if (t.rank() != 2) throw std::invalid_argument("mat: expected a 2-D tensor, got " + shape_string(t.shape()));
  const std::int64_t cols = t.dim(1);
  if (row0 < 0) return {t.raw(), t.dtype(), t.dim(0), cols};
  if (n < 0 || row0 + n > t.dim(0))
    throw std::invalid_argument(fmt::format("mat: rows [{}, {}) outside {}", row0, row0 + n, shape_string(t.shape())));
  const auto* base = static_cast<const char*>(t.raw());
  return {base + row0 * cols * static_cast<std::int64_t>(dtype_size(t.dtype())), t.dtype(), n, cols};
}

MatMut mat_mut(Tensor& t, std::int64_t row0, std::int64_t n) {
  const MatRef r = mat(t, row0, n);
  return {const_cast<void*>(r.data), r.dtype, r.rows, r.cols};
}

MatRef expert_mat(const Tensor& stacked, std::int64_t index) {
  if (stacked.rank() != 3 || index < 0 || index >= stacked.dim(0))
    throw std::invalid_argument(fmt::format("expert_mat: matrix {} of {}", index, shape_string(stacked.shape())));
  const std::int64_t r = stacked.dim(1), c = stacked.dim(2);
  const auto* base = static_cast<const char*>(stacked.raw());
  return {base + index * r * c * static_cast<std::int64_t>(dtype_size(stacked.dtype())), stacked.dtype(), r, c};
}

MatMut expert_mat_mut(Tensor& stacked, std::int64_t index) {
  const MatRef r = expert_mat(stacked, index);
  return {const_cast<void*>(r.data), r.dtype, r.rows, r.cols};
}

void gemm(MatRef a, Trans ta, MatRef b, Trans tb, MatMut c, bool accumulate) {
  run(a, ta, b, tb, c, accumulate);
}

void grouped_gemm(std::span<const GemmProblem> problems, Trans ta, Trans tb, bool accumulate) {
  // Small per-expert GEMMs split poorly across cores, so the groups themselves are spread over
  // the threads, largest first; inside an OpenMP region oneDNN runs each GEMM on the calling
  // thread. Every group is still one single-threaded GEMM wherever it runs: deterministic.
  std::vector<std::size_t> order(problems.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto work = [&](std::size_t i) {
    const auto& p = problems[i];
    // M * K * N = (A's elements) * (the side of B that is not K).
    const auto k = static_cast<double>(ta == Trans::N ? p.a.cols : p.a.rows);
    return static_cast<double>(p.a.rows) * static_cast<double>(p.a.cols) *
           static_cast<double>(p.b.rows) * static_cast<double>(p.b.cols) / std::max(k * k, 1.0);
  };
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return work(a) > work(b); });
  const auto n = static_cast<std::int64_t>(order.size());
  std::exception_ptr error;  // an exception must not leave an OpenMP region: keep the first
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (std::int64_t i = 0; i < n; ++i) {
    const auto& p = problems[order[static_cast<std::size_t>(i)]];
    try {
      run(p.a, ta, p.b, tb, p.c, accumulate, true);
    } catch (...) {
#pragma omp critical(epx_grouped_gemm_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

std::string gemm_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::sse41: return "sse41";
    default: return fmt::format("isa#{}", static_cast<int>(dnnl::get_effective_cpu_isa()));
  }
}

std::string gemm_impl(DType dtype) {
  if (dtype == DType::BF16 && !native_bf16()) return "bf16 widened to f32, " + gemm_impl(DType::F32);
  const auto md_a = op_desc(256, 256, dtype, Trans::N);
  const dnnl::memory::desc md_c({256, 256}, dt::f32, {256, 1});
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md_a, md_a, md_c), engine().engine);
  return pd.impl_info_str();
}

}  // namespace epx
