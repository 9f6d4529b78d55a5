// expert_ffn_cublas.h: the expert FFN on cuBLAS, as moe_bench times it in the formulations that are
// not block-sparse: grouped GEMM on the exact per-expert rows (dropless), one batched GEMM over
// E x [C, D] (padded, dropping), one dense GEMM over every routed row (the baseline).
//   cmake --build build --target moe_bench
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "core/gemm.h"           // Op
#include "moe_bench_harness.h"  // bf16, DeviceBuffer, w1_width

namespace moe::bench {

// ---------------------------------------------------------------------------------------------
// [SECTION] cuBLAS expert FFN (grouped, padded / dropping batched, dense)
// ---------------------------------------------------------------------------------------------

// Which rows of a [rows, .] activation belong to which expert's product.
struct ExpertGroups {
  std::vector<int> expert;        // the weight set of each group
  std::vector<int> rows;          // m of each group's products
  std::vector<size_t> first_row;  // where each group's rows start
};

ExpertGroups capacity_groups(int experts, int capacity);     // padded / dropping: E x [C, .]
ExpertGroups exact_groups(const std::vector<int>& counts);  // dropless grouped: empty experts left out

// A device array of pointers base + index[g] * stride, one per group.
template <typename T>
DeviceBuffer<T*> pointer_table(T* base, const std::vector<size_t>& index, size_t stride) {
  std::vector<T*> pointers;
  for (size_t i : index) pointers.push_back(base + i * stride);
  return DeviceBuffer<T*>(pointers);
}

enum class CublasKind { dense, batched, grouped };

// The activations, gradients and per-group pointer tables of the cuBLAS expert FFN over `rows` rows.
// W1 = the columns of W1 and of pre: H for GeLU, 2H for SwiGLU ([gate | up] per row).
// GeLU: d_hidden doubles as d_pre (gelu_backward is elementwise, so it can overwrite its input).
// SwiGLU: d_pre [rows, 2H] is a buffer of its own ([d_gate | d_up], twice d_hidden's width).
struct CublasFfn {
  CublasFfn(size_t rows, int model_dim, int hidden_dim, moe::Activation activation, ExpertGroups groups_in,
            const bf16* w1, const bf16* w2, int weight_sets)
      : rows(rows), D(model_dim), H(hidden_dim), W1(w1_width(hidden_dim, activation)), activation(activation),
        groups(std::move(groups_in)), w1(w1), w2(w2), x(rows * D), pre(rows * W1), hidden(rows * H),
        out(rows * D), d_out(rows * D), d_hidden(rows * H), d_pre_swiglu(swiglu() ? rows * W1 : 0), dx(rows * D),
        dw1(size_t(weight_sets) * D * W1), dw2(size_t(weight_sets) * H * D) {
    const std::vector<size_t>& r = groups.first_row;
    std::vector<size_t> e(groups.expert.begin(), groups.expert.end());
    const size_t DW1 = size_t(D) * W1, HD = size_t(H) * D;
    bf16* const d_pre = swiglu() ? d_pre_swiglu.data() : d_hidden.data();
    x_of = pointer_table<const bf16>(x.data(), r, D);
    hidden_of = pointer_table<const bf16>(hidden.data(), r, H);
    d_out_of = pointer_table<const bf16>(d_out.data(), r, D);
    d_pre_of = pointer_table<const bf16>(d_pre, r, W1);
    w1_of = pointer_table<const bf16>(w1, e, DW1);
    w2_of = pointer_table<const bf16>(w2, e, HD);
    pre_of = pointer_table<bf16>(pre.data(), r, W1);
    out_of = pointer_table<bf16>(out.data(), r, D);
    d_hidden_of = pointer_table<bf16>(d_hidden.data(), r, H);
    dx_of = pointer_table<bf16>(dx.data(), r, D);
    dw1_of = pointer_table<bf16>(dw1.data(), weight_sets == 1 ? std::vector<size_t>(e.size(), 0) : e, DW1);
    dw2_of = pointer_table<bf16>(dw2.data(), weight_sets == 1 ? std::vector<size_t>(e.size(), 0) : e, HD);
  }
  // GeLU: pre, hidden, d_hidden (= d_pre): 3H per row; SwiGLU: pre 2H, hidden, d_hidden, d_pre 2H: 6H.
  static size_t bytes(size_t rows, int D, int H, moe::Activation activation, int weight_sets) {
    const size_t W1 = size_t(w1_width(H, activation));
    const size_t hidden_widths = activation == moe::Activation::swiglu ? 2 * W1 + 2 * size_t(H) : 3 * size_t(H);
    return rows * (4 * size_t(D) + hidden_widths) * sizeof(bf16) +
           size_t(weight_sets) * D * (W1 + size_t(H)) * sizeof(bf16);
  }
  bool swiglu() const { return activation == moe::Activation::swiglu; }
  bf16* d_pre() { return swiglu() ? d_pre_swiglu.data() : d_hidden.data(); }  // [rows, W1]
  void poison_results() {
    out.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    dw1.fill_bytes(0xFF);
    dw2.fill_bytes(0xFF);
  }

  size_t rows;
  int D, H, W1;
  moe::Activation activation;
  ExpertGroups groups;
  const bf16* w1;  // [E, D, W1]  (dense: expert 0's [D, W1])
  const bf16* w2;  // [E, H, D]
  DeviceBuffer<bf16> x, pre, hidden, out, d_out, d_hidden, d_pre_swiglu, dx;  // [rows, D], [rows, W1], [rows, H]
  DeviceBuffer<bf16> dw1, dw2;  // [weight_sets, D, W1], [weight_sets, H, D]
  DeviceBuffer<const bf16*> x_of, hidden_of, d_out_of, d_pre_of, w1_of, w2_of;
  DeviceBuffer<bf16*> pre_of, out_of, d_hidden_of, dx_of, dw1_of, dw2_of;
};

// pre = x W1 [rows, W1];  hidden = act(pre) [rows, H];  out = hidden W2 [rows, D].
void cublas_ffn_forward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream);

// dh = dy W2ᵀ;  d_pre = act'(dh, pre) [rows, W1];  dW2 = hᵀ dy;  dW1 = xᵀ d_pre;  dx = d_pre W1ᵀ.
void cublas_ffn_backward(cublasHandle_t handle, CublasKind kind, CublasFfn& f, cudaStream_t stream);

}  // namespace moe::bench
