// One-token (decode) attention over a paged KV pool, read in place, for CPUs.
//
// Built at run time by cpu_paged_attention.py (torch.utils.cpp_extension.load); see its docstring
// for the layout. The G query heads sharing a K/V head are scored together, so every K and V vector
// of a row's blocks is read from memory exactly once per call (grouped-query attention folded),
// with an online softmax (running max and sum per query head): nothing but the output is written.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A K or V vector as fp32: the pool's own memory (fp32 pool) or converted into `buf` (bf16 pool).
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n);

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

template <>
inline const float* as_float<uint16_t>(const uint16_t* src, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(src[i]);
  return buf;
}

// A block's `ntok` K or V rows of `width` as fp32 rows: the pool's own memory with its token stride
// (fp32 pool), or converted once into `buf` with stride `width` (bf16 pool). Sets `stride`.
template <typename T>
inline const float* block_rows_fp32(const T* src, int64_t tok_stride, int64_t ntok, int64_t width,
                                    std::vector<float>& buf, int64_t& stride) {
  if constexpr (std::is_same<T, float>::value) {
    stride = tok_stride;
    return src;
  } else {
    for (int64_t t = 0; t < ntok; ++t) as_float<T>(src + t * tok_stride, buf.data() + t * width, width);
    stride = width;
    return buf.data();
  }
}

// exp(x) for x <= 0 (softmax after subtracting the max), vectorisable: 2^n · p(r) with
// r = x - n·ln2 in [-ln2/2, ln2/2] and a degree-6 polynomial (relative error ~2e-7); x < -87 -> 0.
inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Prefetch a block's bytes (it sits anywhere in the pool, so the hardware prefetcher cannot guess it).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// D / DV > 0: head sizes known at compile time (fully unrolled); 0: taken from the arguments.
//
// Work item = (row, split): a split is a run of the row's blocks (rows are split only when there
// are fewer rows than threads), and it walks its blocks in order, all K/V heads of a block
// together, so the block's K (and then V) bytes are read once, sequentially, while the next
// block is prefetched. Per query head a split keeps a running max m, sum l and output acc; the
// splits of a row are merged at the end (m, l rescaled to the row's max).
template <typename T, int D_, int DV_>
void decode_kernel(const float* q, const T* kp, const T* vp, const int32_t* tables, const int32_t* lengths,
                   float* out, int64_t rows, int64_t hkv, int64_t g, int64_t d_rt, int64_t dv_rt, int64_t bs,
                   int64_t max_blocks, float scale, int64_t k_block_stride, int64_t k_tok_stride,
                   int64_t v_block_stride, int64_t v_tok_stride, int64_t splits) {
  const int64_t d = D_ ? D_ : d_rt, dv = DV_ ? DV_ : dv_rt;
  const int64_t hq = hkv * g;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> pm(rows * splits * hq, neg_inf), pl(rows * splits * hq, 0.f), pacc(rows * splits * hq * dv, 0.f);
  at::parallel_for(0, rows * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * bs), qs(hq * d), kbuf(bs * d), vbuf(bs * dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / splits, sp = item % splits;
      const int64_t len = lengths[r];
      const int64_t nblocks = (len + bs - 1) / bs;
      const int64_t per = (nblocks + splits - 1) / splits;
      const int64_t b0 = sp * per, b1 = std::min(nblocks, b0 + per);
      if (b0 >= b1) continue;
      float* m = pm.data() + item * hq;
      float* l = pl.data() + item * hq;
      float* acc = pacc.data() + item * hq * dv;
      const float* qr = q + r * hq * d;
      for (int64_t i = 0; i < hq * d; ++i) qs[i] = qr[i] * scale;
      for (int64_t bi = b0; bi < b1; ++bi) {
        const int64_t blk = tables[r * max_blocks + bi];
        const int64_t ntok = std::min(bs, len - bi * bs);
        if (bi + 1 < b1) {
          const int64_t nxt = tables[r * max_blocks + bi + 1];
          const int64_t nt = std::min(bs, len - (bi + 1) * bs);
          prefetch_bytes(kp + nxt * k_block_stride, nt * k_tok_stride * int64_t(sizeof(T)));
          prefetch_bytes(vp + nxt * v_block_stride, nt * v_tok_stride * int64_t(sizeof(T)));
        }
        for (int64_t h = 0; h < hkv; ++h) {
          const T* kb = kp + blk * k_block_stride + h * d;
          const T* vb = vp + blk * v_block_stride + h * dv;
          int64_t kstride;
          const float* kf = block_rows_fp32<T>(kb, k_tok_stride, ntok, d, kbuf, kstride);
          for (int64_t j = 0; j < g; ++j) {  // one query head's q stays in registers over the block
            const float* __restrict qj = qs.data() + (h * g + j) * d;
            for (int64_t t = 0; t < ntok; ++t) {
              const float* __restrict kr = kf + t * kstride;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t i = 0; i < d; ++i) s += qj[i] * kr[i];
              scores[j * bs + t] = s;
            }
          }
          for (int64_t j = 0; j < g; ++j) {
            const int64_t qh = h * g + j;
            float* __restrict s = scores.data() + j * bs;
            float bm = m[qh];
            for (int64_t t = 0; t < ntok; ++t) bm = std::max(bm, s[t]);
            const float corr = m[qh] == neg_inf ? 0.f : exp_nonpos(m[qh] - bm);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < ntok; ++t) {
              s[t] = exp_nonpos(s[t] - bm);
              sum += s[t];
            }
            l[qh] = l[qh] * corr + sum;
            m[qh] = bm;
            if (corr != 1.f) {
              float* __restrict a = acc + qh * dv;
#pragma omp simd
              for (int64_t i = 0; i < dv; ++i) a[i] *= corr;
            }
          }
          int64_t vstride;
          const float* vf = block_rows_fp32<T>(vb, v_tok_stride, ntok, dv, vbuf, vstride);
          for (int64_t j = 0; j < g; ++j) {  // one query head's output stays in registers over the block
            const float* __restrict p = scores.data() + j * bs;
            float* __restrict a = acc + (h * g + j) * dv;
            for (int64_t t = 0; t < ntok; ++t) {
              const float* __restrict vr = vf + t * vstride;
              const float pt = p[t];
#pragma omp simd
              for (int64_t i = 0; i < dv; ++i) a[i] += pt * vr[i];
            }
          }
        }
      }
    }
  });
  at::parallel_for(0, rows * hq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hq, qh = item % hq;
      float mx = neg_inf;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, pm[(r * splits + sp) * hq + qh]);
      float* o = out + item * dv;
      std::fill(o, o + dv, 0.f);
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t at = (r * splits + sp) * hq + qh;
        if (pl[at] == 0.f) continue;  // an empty split
        const float w = exp_nonpos(pm[at] - mx);
        total += pl[at] * w;
        const float* a = pacc.data() + at * dv;
        for (int64_t i = 0; i < dv; ++i) o[i] += w * a[i];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t i = 0; i < dv; ++i) o[i] *= inv;
    }
  });
}

template <typename T>
void dispatch(const float* q, const T* kp, const T* vp, const int32_t* tab, const int32_t* len, float* out,
              int64_t rows, int64_t hkv, int64_t g, int64_t d, int64_t dv, int64_t bs, int64_t max_blocks, float sc,
              int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, int64_t sp) {
  if (d == 64 && dv == 64) {
    decode_kernel<T, 64, 64>(q, kp, vp, tab, len, out, rows, hkv, g, d, dv, bs, max_blocks, sc, ks0, ks1, vs0, vs1, sp);
  } else if (d == 128 && dv == 128) {
    decode_kernel<T, 128, 128>(q, kp, vp, tab, len, out, rows, hkv, g, d, dv, bs, max_blocks, sc, ks0, ks1, vs0, vs1, sp);
  } else {
    decode_kernel<T, 0, 0>(q, kp, vp, tab, len, out, rows, hkv, g, d, dv, bs, max_blocks, sc, ks0, ks1, vs0, vs1, sp);
  }
}

}  // namespace

// q [rows, Hq, D] fp32; k_pool [blocks, bs, Hkv, D] and v_pool [blocks, bs, Hkv, Dv], fp32 or bf16,
// each block contiguous in its last three dims; block_tables [rows, max_blocks] int32 (entries past a
// row's length are never read); lengths [rows] int32, each >= 1. Returns [rows, Hq, Dv] fp32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                           torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: [rows, Hq, D] float32");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "pools: [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && lengths.scalar_type() == at::kInt, "int32 tables/lengths");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  lengths = lengths.contiguous();
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t nb = k_pool.size(0), bs = k_pool.size(1), hkv = k_pool.size(2), dv = v_pool.size(3);
  TORCH_CHECK(k_pool.size(3) == d && v_pool.size(0) == nb && v_pool.size(1) == bs && v_pool.size(2) == hkv,
              "pool shapes do not match q");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(k_pool.stride(3) == 1 && k_pool.stride(2) == d && v_pool.stride(3) == 1 && v_pool.stride(2) == dv,
              "pool blocks must be contiguous in (Hkv, D)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows && lengths.numel() == rows,
              "one block table and one length per row");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tab = block_tables.data_ptr<int32_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= max_blocks * bs, "row length out of its block table");
    for (int64_t b = 0; b < (len[r] + bs - 1) / bs; ++b) {
      const int32_t id = tab[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < nb, "block id out of the pool");
    }
  }
  auto out = torch::empty({rows, hq, dv}, q.options());
  // Split rows over their blocks only when there are fewer rows than about twice the threads.
  int64_t longest = 1;
  for (int64_t r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, (len[r] + bs - 1) / bs);
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + rows - 1) / std::max<int64_t>(rows, 1),
                                                                 (longest + 7) / 8));
  const float sc = static_cast<float>(scale);
  if (k_pool.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tab, len,
                         out.data_ptr<float>(), rows, hkv, hq / hkv, d, dv, bs, max_blocks, sc, k_pool.stride(0),
                         k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), splits);
  } else if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch<uint16_t>(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
                            reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()), tab, len,
                            out.data_ptr<float>(), rows, hkv, hq / hkv, d, dv, bs, max_blocks, sc, k_pool.stride(0),
                            k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), splits);
  } else {
    TORCH_CHECK(false, "pool dtype must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "one-token attention over a paged KV pool (CPU)");
}
