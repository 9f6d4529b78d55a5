// lesson04_backward.cpp: Lesson 04, the backward pass of a dropless MoE layer. Which block-sparse
// product computes each gradient, how the transpose indices let a kernel walk a block column top
// to bottom without a transposed copy, the block-sparse backward shown equal to the per-expert one,
// finite differences on single entries, and how the router's gradient splits into the part from
// the combine weights and the parts from the aux and z losses. Where a GPU is present, the GPU
// layer's gradients are checked against the CPU reference. Read lessons/04_backward.md.
//
// Build and run:  ./moe build && build/lessons/lesson04_backward [--out runs/lesson04_backward]
//
// The CPU part runs the CPU reference (moe::ref, double precision). The GPU part is compiled only
// when CMake found CUDA (MOE_LESSON_HAS_CUDA) and runs only when a GPU is present.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k, B block size.
#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "reference_cpu/block_sparse.h"  // moe::ref::sdd, dsd, dds
#include "block_sparse_ffn.h"            // concat_expert_columns, concat_expert_rows
#include "expert_ffn.h"                  // gelu, gelu_derivative
#include "init.h"                        // random_matrix, random_weights
#include "lesson_support.h"              // options, zipf_tokens, Table
#include "reference_cpu/moe_layer.h"     // moe_forward, moe_backward, moe_objective

#ifdef MOE_LESSON_HAS_CUDA
#include "moe/block_sparse.h"       // expert_pointer_table
#include "core/bf16.h"              // bf16, to_bf16
#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/device_buffer.h"     // DeviceBuffer
#include "core/device_info.h"       // gpu_available, why_no_gpu, current_device
#include "moe/moe_layer.h"          // MoeLayerGpu
#include "bridge/reference_bridge.h"  // round_bf16, bf16_of, matrix_of
#endif

using namespace moe;
using moe::lessons::Table;
using moe::lessons::relative_error;
using moe::ref::Matrix;

namespace {

using moe::lessons::relative_error;  // the Matrix overload, beside the per-expert one below

double relative_error(const std::vector<Matrix>& a, const std::vector<Matrix>& reference) {
  double diff = 0, norm = 0;
  for (size_t e = 0; e < reference.size(); ++e) {
    diff += (a[e] - reference[e]).squaredNorm();
    norm += reference[e].squaredNorm();
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// The layer's inputs: text-like tokens, weights with a confident router (real skew), and a random dy.
struct Problem {
  MoeConfig config;
  Matrix x, dy;  // [T, D]
  ref::MoeWeights weights;
};

Problem make_problem(const MoeConfig& config, int64_t vocabulary, uint64_t seed) {
  Problem p{config, {}, {}, ref::random_weights(config, seed + 1)};
  std::mt19937_64 generator(seed);
  p.x = lessons::zipf_tokens(config.tokens, config.model_dim, vocabulary, 1.1, generator);
  p.dy = ref::random_matrix(config.tokens, config.model_dim, generator);
  p.weights.gate_weights *= 3.0;
  return p;
}

// The central difference of L = moe_objective along one entry of one tensor; `entry` points into
// the problem's own storage and is restored afterwards.
double finite_difference(Problem& p, double* entry, double step) {
  const double saved = *entry;
  auto objective = [&](double value) {
    *entry = value;
    const ref::LayerForward forward = ref::moe_forward(p.config, p.x, p.weights);
    return ref::moe_objective(p.config, forward, p.dy);
  };
  const double plus = objective(saved + step), minus = objective(saved - step);
  *entry = saved;
  return (plus - minus) / (2 * step);
}

// Index of the entry of largest magnitude: a finite difference there is not lost in rounding.
int64_t argmax_abs(const Matrix& m) {
  Eigen::Index row = 0, col = 0;
  m.cwiseAbs().maxCoeff(&row, &col);
  return row * m.cols() + col;
}

#ifdef MOE_LESSON_HAS_CUDA
// ---- the GPU part: MoeLayerGpu forward + backward against moe_forward / moe_backward ----

constexpr double kGpuTolerance = 2e-2;  // bf16 activations, fp32 accumulation and gradients

using cuda::bf16_of;  // reference_bridge.h
using cuda::matrix_of;
using cuda::round_bf16;

std::vector<Matrix> experts_of(const std::vector<float>& v, int64_t experts, int64_t rows, int64_t cols) {
  std::vector<Matrix> out;
  for (int64_t e = 0; e < experts; ++e) out.push_back(matrix_of(v, rows, cols, size_t(e * rows * cols)));
  return out;
}

lessons::GpuPart gpu_gradient_check(RunWriter& writer, uint64_t seed) {
  if (!cuda::gpu_available()) return lessons::skip_gpu_part(cuda::why_no_gpu());
  MoeConfig config;
  config.tokens = 1000;     // T: not a multiple of B
  config.model_dim = 256;   // D
  config.hidden_dim = 512;  // H
  config.num_experts = 8;   // E
  config.top_k = 2;         // K
  config.block_size = 64;   // B: the GPU kernels take 64 or 128
  config.renormalize = true;
  config.aux_loss_coef = 0.01;
  config.z_loss_coef = 0.001;
  const int64_t T = config.tokens, D = config.model_dim, H = config.hidden_dim, E = config.num_experts;

  // Inputs rounded to bf16 first, so the reference computes from exactly the values the GPU sees.
  std::mt19937_64 generator(seed + 200);
  ref::MoeWeights weights = ref::random_weights(config, seed + 201);
  weights.gate_weights = round_bf16(weights.gate_weights);
  for (auto& w : weights.w1) w = round_bf16(w);
  for (auto& w : weights.w2) w = round_bf16(w);
  const Matrix x = round_bf16(ref::random_matrix(T, D, generator));
  const Matrix dy = round_bf16(ref::random_matrix(T, D, generator));
  const ref::LayerForward reference = ref::moe_forward(config, x, weights);
  const ref::LayerGradients reference_grads = ref::moe_backward(config, x, weights, reference, dy);

  cuda::DeviceBuffer<cuda::bf16> x_gpu(bf16_of(x)), dy_gpu(bf16_of(dy)), gate(bf16_of(weights.gate_weights));
  cuda::DeviceBuffer<cuda::bf16> w1(bf16_of(weights.w1)), w2(bf16_of(weights.w2)), y(size_t(T * D));
  auto w1_table = cuda::expert_pointer_table<const cuda::bf16>(w1.data(), int(E), size_t(D * H));
  auto w2_table = cuda::expert_pointer_table<const cuda::bf16>(w2.data(), int(E), size_t(H * D));
  cuda::DeviceBuffer<float> dx(size_t(T * D)), d_gate(size_t(D * E)), d_w1(size_t(E * D * H)), d_w2(size_t(E * H * D));
  auto d_w1_table = cuda::expert_pointer_table(d_w1.data(), int(E), size_t(D * H));
  auto d_w2_table = cuda::expert_pointer_table(d_w2.data(), int(E), size_t(H * D));
  for (auto* buffer : {&dx, &d_gate, &d_w1, &d_w2}) buffer->fill_bytes(0xFF);  // NaN until written
  y.fill_bytes(0xFF);

  cuda::MoeLayerGpu layer(config);
  const cuda::MoeLayerWeights w{gate.data(), w1_table.data(), w2_table.data()};
  layer.forward(x_gpu.data(), w, y.data(), nullptr);
  layer.backward(x_gpu.data(), w, dy_gpu.data(), {dx.data(), d_gate.data(), d_w1_table.data(), d_w2_table.data()},
                 nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());

  // Gradients are only comparable if the GPU routed every slot as the reference did.
  const std::vector<int> top = layer.top_experts().download();
  int64_t flips = 0;
  for (int64_t i = 0; i < T * config.top_k; ++i) flips += top[size_t(i)] != reference.router.top_experts.data()[i];

  Table table("Table 7: GPU layer (MoeLayerGpu, dropless, bf16) vs moe_forward / moe_backward (double)",
              {"tensor", "shape", "computed on the GPU by", "rel err", "tol", "finite"});
  bool pass = flips == 0;
  std::ostringstream message;
  auto add = [&](const std::string& name, const std::string& shape, const std::string& how, double error,
                 bool finite) {
    pass = pass && finite && error < kGpuTolerance;
    table.add_row({name, shape, how, error, kGpuTolerance, finite ? "yes" : "NO"});
    message << " " << name << "=" << std::scientific << std::setprecision(1) << error;
  };
  const Matrix y_gpu = matrix_of(y.download(), T, D);
  const Matrix dx_gpu = matrix_of(dx.download(), T, D), d_gate_gpu = matrix_of(d_gate.download(), D, E);
  const auto d_w1_gpu = experts_of(d_w1.download(), E, D, H), d_w2_gpu = experts_of(d_w2.download(), E, H, D);
  bool experts_finite = true;
  for (int64_t e = 0; e < E; ++e) experts_finite = experts_finite && d_w1_gpu[e].allFinite() && d_w2_gpu[e].allFinite();
  add("y", "[T, D]", "forward: SDD+GeLU, DSD, combine", relative_error(y_gpu, reference.y), y_gpu.allFinite());
  add("dW2", "E x [H, D]", "DS^TD through transpose_indices", relative_error(d_w2_gpu, reference_grads.w2), experts_finite);
  add("dW1", "E x [D, H]", "DDS on d_pre = GeLU'(pre) . SDD(d_out, W2^T)", relative_error(d_w1_gpu, reference_grads.w1),
      experts_finite);
  add("dx", "[T, D]", "DSD(d_pre, W1^T), un-permute, + router", relative_error(dx_gpu, reference_grads.x), dx_gpu.allFinite());
  add("dWg", "[D, E]", "softmax + top-K backward, aux, z", relative_error(d_gate_gpu, reference_grads.gate_weights),
      d_gate_gpu.allFinite());

  std::cout << "\nGPU part on " << cuda::current_device().name << ": T=" << T << " D=" << D << " H=" << H
            << " E=" << E << " K=" << config.top_k << " B=" << config.block_size
            << ", renormalised top-K, aux 0.01, z 0.001; slots routed differently from the reference: " << flips
            << "\n";
  lessons::show(writer, table);
  return {pass, "GPU rel_err" + message.str() + " tol=2e-2, routing flips=" + std::to_string(flips)};
}

// The run record's GPU, where one is present.
std::string gpu_name() { return cuda::gpu_available() ? cuda::current_device().name : ""; }
#else
lessons::GpuPart gpu_gradient_check(RunWriter&, uint64_t) { return lessons::skip_gpu_part_not_built(); }
std::string gpu_name() { return ""; }
#endif

// ---- 1. which product computes which gradient ----

void show_gradient_products(RunWriter& writer) {
  Table map("Table 1: the gradients of the expert FFN and the product that computes each (MegaBlocks 5.1)",
            {"gradient", "formula", "product", "sparse operand read as", "shape"});
  map.add_row({"d_out", "w_tk dy_t at row(t, k)", "(combine backward)", "-", "[rows, D]"});
  map.add_row({"dW2", "h^T d_out", "DS^TD", "S^T: transpose_indices", "E x [H, D]"});
  map.add_row({"d_pre", "act'(pre) . (d_out W2^T)", "SDD, act' fused", "output blocks", "[nnz*B, B]"});
  map.add_row({"dW1", "x^T d_pre", "DDS", "S: blocks by row", "E x [D, H]"});
  map.add_row({"d_x (rows)", "d_pre W1^T", "DSD", "S: blocks by row", "[rows, D]"});
  map.add_row({"dx", "un-permute d_x rows + d_logits Wg^T", "(scatter, dense)", "-", "[T, D]"});
  map.add_row({"dWg", "x^T d_logits", "(dense)", "-", "[D, E]"});
  lessons::show(writer, map);
}

// ---- 2. the transpose indices walk a block column top to bottom ----

// Returns whether every block column's walk goes top to bottom.
bool show_transpose_walk(RunWriter& writer, const MoeConfig& small, const ref::LayerForward& forward) {
  const ref::BlockSparseTopology& topology = *forward.topology;
  const int64_t B = small.block_size, H = small.hidden_dim;
  std::cout << "\nBlock ids of the small case (row-major, as in lesson 03); '.' = no block:\n";
  for (int64_t r = 0; r < topology.block_rows; ++r) {
    std::vector<std::string> cells(topology.block_cols, " .");
    for (int32_t i = topology.offsets[r]; i < topology.offsets[r + 1]; ++i) {
      std::ostringstream id;
      id << std::setw(2) << i;
      cells[topology.column_indices[i]] = id.str();
    }
    std::cout << "  block row " << std::setw(2) << r << " (e" << topology.block_row_expert[r] << ")  ";
    for (const auto& cell : cells) std::cout << " " << cell;
    std::cout << "\n";
  }
  Table walk("Table 2: walking each block column through column_offsets and transpose_indices",
             {"block column", "expert", "transpose_indices[a..b]", "block ids", "their block rows", "top to bottom"});
  bool walks_ok = true;
  for (int64_t c = 0; c < topology.block_cols; ++c) {
    const int32_t first = topology.column_offsets[c], last = topology.column_offsets[c + 1];
    std::ostringstream ids, rows;
    bool ordered = true;
    for (int32_t j = first; j < last; ++j) {
      const int32_t block = topology.transpose_indices[j];
      ids << (j > first ? " " : "") << block;
      rows << (j > first ? " " : "") << topology.row_indices[block];
      ordered = ordered && topology.column_indices[block] == c &&
                (j == first || topology.row_indices[block] > topology.row_indices[topology.transpose_indices[j - 1]]);
    }
    walks_ok = walks_ok && ordered;
    const std::string range = last > first ? std::to_string(first) + ".." + std::to_string(last - 1) : "(empty)";
    walk.add_row({c, c / (H / B), range, ids.str(), rows.str(), ordered ? "yes" : "NO"});
  }
  lessons::show(writer, walk);
  std::cout << "  Row-major, the blocks of one column are H/B = " << H / B
            << " ids apart; transpose_indices lists them in order, so a DSᵀD\n"
               "  kernel reads S's blocks in place as Sᵀ and never builds a transposed copy.\n";
  std::vector<int64_t> rows_per_expert(forward.plan.rows_per_expert.begin(), forward.plan.rows_per_expert.end());
  writer.append(to_event(TopologyEvent{.step = 0, .layer = 0, .block_size = B,
                                       .block_rows = topology.block_rows, .block_cols = topology.block_cols,
                                       .nnz = topology.nnz, .padding_rows = forward.plan.padding_rows,
                                       .rows_per_expert = rows_per_expert}));
  return walks_ok;
}

// The four backward products on the small case, each against its dense, masked equivalent; returns
// the largest relative error.
double show_backward_products(RunWriter& writer, const MoeConfig& small, const Problem& p,
                              const ref::LayerForward& forward) {
  const ref::BlockSparseTopology& topology = *forward.topology;
  const int64_t B = small.block_size, H = small.hidden_dim;
  Matrix d_out = Matrix::Zero(forward.plan.total_rows, small.model_dim);  // [rows, D]
  for (int64_t t = 0; t < small.tokens; ++t) {
    for (int64_t k = 0; k < small.top_k; ++k) {
      d_out.row(forward.plan.slot_row[t * small.top_k + k]) = forward.router.combine_weights(t, k) * p.dy.row(t);
    }
  }
  const Matrix w1_cat = ref::concat_expert_columns(p.weights.w1, 0, H);  // [D, E*H]
  const Matrix w2_cat = ref::concat_expert_rows(p.weights.w2);           // [E*H, D]
  const Matrix pre = ref::sdd(forward.permuted_x, w1_cat, topology);     // blocks
  const Matrix hidden = pre.unaryExpr([](double a) { return ref::gelu(a); });
  const Matrix d_hidden = ref::sdd(d_out, w2_cat.transpose(), topology);
  const Matrix d_pre = d_hidden.cwiseProduct(pre.unaryExpr([](double a) { return ref::gelu_derivative(a); }));
  const Matrix hidden_dense = ref::sparse_to_dense(topology, hidden), d_pre_dense = ref::sparse_to_dense(topology, d_pre);
  const Matrix mask = ref::sparse_to_dense(topology, Matrix::Ones(topology.nnz * B, B));
  const Matrix d_pre_masked =
      (d_out * w2_cat.transpose()).cwiseProduct(mask).cwiseProduct(
          (forward.permuted_x * w1_cat).unaryExpr([](double a) { return ref::gelu_derivative(a); }));

  Table products("Table 3: the backward products on the CPU reference vs dense products (small case)",
                 {"gradient", "block-sparse", "dense equivalent", "rel err"});
  const double dw2_error = relative_error(ref::dsd(topology, hidden, /*transpose_s=*/true, d_out),
                                          hidden_dense.transpose() * d_out);
  const double d_pre_error = relative_error(ref::sparse_to_dense(topology, d_pre), d_pre_masked);
  const double dw1_error = relative_error(ref::dds(forward.permuted_x.transpose(), topology, d_pre, false),
                                          forward.permuted_x.transpose() * d_pre_dense);
  const double dx_error = relative_error(ref::dsd(topology, d_pre, false, w1_cat.transpose()),
                                         d_pre_dense * w1_cat.transpose());
  products.add_row({"dW2cat [E*H, D]", "dsd(hidden, transpose_s)", "dense(h)^T d_out", dw2_error});
  products.add_row({"d_pre blocks", "sdd(d_out, W2cat^T) . gelu'", "mask . (d_out W2cat^T) . gelu'(x W1cat)", d_pre_error});
  products.add_row({"dW1cat [D, E*H]", "dds(x^T, d_pre)", "x^T dense(d_pre)", dw1_error});
  products.add_row({"d_x rows [rows, D]", "dsd(d_pre, W1cat^T)", "dense(d_pre) W1cat^T", dx_error});
  lessons::show(writer, products);
  return std::max({dw2_error, d_pre_error, dw1_error, dx_error});
}

// ---- 3. block-sparse backward == per-expert backward, and finite differences ----

// The medium case: renormalised top-2 with both router losses on.
MoeConfig medium_config() {
  MoeConfig medium;
  medium.tokens = 512;
  medium.model_dim = 32;
  medium.hidden_dim = 64;
  medium.num_experts = 8;
  medium.top_k = 2;
  medium.block_size = 16;
  medium.formulation = Formulation::dropless;
  medium.renormalize = true;
  medium.aux_loss_coef = 0.01;
  medium.z_loss_coef = 0.001;
  return medium;
}

// Returns the largest relative error between the two expert paths over both cases.
double compare_expert_paths(RunWriter& writer, Problem& p, Problem& q) {
  Table paths("Table 4: moe_backward, ExpertPath::block_sparse vs ExpertPath::per_expert",
              {"case", "dx", "dWg", "dW1", "dW2", "tol"});
  double paths_error = 0;
  for (Problem* problem : {&p, &q}) {
    const ref::LayerForward f = ref::moe_forward(problem->config, problem->x, problem->weights);
    const auto sparse = ref::moe_backward(problem->config, problem->x, problem->weights, f, problem->dy,
                                          ref::ExpertPath::block_sparse);
    const auto dense = ref::moe_backward(problem->config, problem->x, problem->weights, f, problem->dy,
                                         ref::ExpertPath::per_expert);
    const double errors[] = {relative_error(sparse.x, dense.x), relative_error(sparse.gate_weights, dense.gate_weights),
                             relative_error(sparse.w1, dense.w1), relative_error(sparse.w2, dense.w2)};
    for (double e : errors) paths_error = std::max(paths_error, e);
    const MoeConfig& c = problem->config;
    std::ostringstream name;
    name << "T=" << c.tokens << " E=" << c.num_experts << " K=" << c.top_k << " B=" << c.block_size;
    paths.add_row({name.str(), errors[0], errors[1], errors[2], errors[3], 1e-12});
  }
  lessons::show(writer, paths);
  return paths_error;
}

// Finite differences of L = sum(dy . y) + 0.01 aux + 0.001 z, each at the entry of the largest
// gradient, on the medium case (renormalised top-2, both router losses on).
// Returns the largest relative error.
double show_finite_differences(RunWriter& writer, const MoeConfig& medium, Problem& q, const ref::LayerForward& fq,
                               const ref::LayerGradients& gq) {
  int64_t busiest = 0;
  for (int64_t e = 0; e < medium.num_experts; ++e) {
    if (fq.plan.tokens_per_expert[e] > fq.plan.tokens_per_expert[busiest]) busiest = e;
  }
  struct Probe {
    std::string name;
    Matrix* tensor;
    const Matrix* gradient;
  };
  const Probe probes[] = {
      {"W1[e" + std::to_string(busiest) + "]", &q.weights.w1[busiest], &gq.w1[busiest]},
      {"W2[e" + std::to_string(busiest) + "]", &q.weights.w2[busiest], &gq.w2[busiest]},
      {"Wg (router)", &q.weights.gate_weights, &gq.gate_weights},
      {"x", &q.x, &gq.x},
  };
  Table differences("Table 5: finite differences (central, step 1e-6) of L at the largest-gradient entry",
                    {"tensor", "entry (row, col)", "moe_backward", "finite difference", "rel err", "tol"});
  double fd_error = 0;
  for (const Probe& probe : probes) {
    const int64_t index = argmax_abs(*probe.gradient);
    const double analytic = probe.gradient->data()[index];
    const double numeric = finite_difference(q, probe.tensor->data() + index, 1e-6);
    const double error = std::abs(numeric - analytic) / std::abs(analytic);
    fd_error = std::max(fd_error, error);
    const int64_t cols = probe.tensor->cols();
    std::ostringstream entry;  // (row, column); a stream, where "(" + std::string trips GCC 12's -Wrestrict
    entry << "(" << index / cols << ", " << index % cols << ")";
    differences.add_row({probe.name, entry.str(), analytic, numeric, error, 1e-6});
  }
  lessons::show(writer, differences);
  return fd_error;
}

// ---- 4. the router's gradient, term by term ----

// Returns the relative error of the three terms' sum against the whole.
double show_router_terms(RunWriter& writer, const MoeConfig& medium, const Problem& q, const ref::LayerForward& fq,
                         const ref::LayerGradients& gq) {
  // With the routing fixed, L is linear in dy and in the two loss weights, so the router gradient
  // is the sum of three parts: through the combine weights (dy), through P_e (aux), through the
  // logsumexp (z). f_e and the top-K choice carry none.
  auto gate_gradient = [&](double aux, double z, bool with_dy) {
    MoeConfig c = medium;
    c.aux_loss_coef = aux;
    c.z_loss_coef = z;
    const Matrix dy = with_dy ? q.dy : Matrix::Zero(q.dy.rows(), q.dy.cols());
    return ref::moe_backward(c, q.x, q.weights, fq, dy).gate_weights;
  };
  const Matrix from_dy = gate_gradient(0, 0, true), from_aux = gate_gradient(medium.aux_loss_coef, 0, false);
  const Matrix from_z = gate_gradient(0, medium.z_loss_coef, false);
  const double split_error = relative_error(from_dy + from_aux + from_z, gq.gate_weights);
  Table split("Table 6: the router gradient dWg, term by term (medium case)",
              {"term", "what it pushes", "||dWg||"});
  split.add_row({"sum(dy . y)", "each chosen prob, by dy_t . (its expert's output)", from_dy.norm()});
  split.add_row({"0.01 aux", "every token's prob of the busy experts down (weight f_e)", from_aux.norm()});
  split.add_row({"0.001 z", "all logits towards small logsumexp", from_z.norm()});
  split.add_row({"all three (moe_backward)", "rel err of the sum vs the whole: " + [&] {
                   std::ostringstream s;
                   s << std::scientific << std::setprecision(1) << split_error;
                   return s.str();
                 }(), gq.gate_weights.norm()});
  lessons::show(writer, split);
  return split_error;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = lessons::parse_options(argc, argv, "lesson04_backward", "runs/lesson04_backward");

  // The small case of lesson 03: 24 text-like tokens, 4 experts of hidden width 8, 4 x 4 blocks.
  const MoeConfig small = lessons::small_block_case();

  auto writer = lessons::create_lesson_run(options, "lesson04_backward", "04", small, lessons::cpu_and_gpu_devices(gpu_name()));

  std::cout << "Lesson 04: the backward pass. Small case: T=" << small.tokens << ", D=" << small.model_dim
            << ", H=" << small.hidden_dim << ", E=" << small.num_experts << ", K=" << small.top_k
            << ", B=" << small.block_size << "\n";

  Problem p = make_problem(small, 12, options.seed);
  const ref::LayerForward forward = ref::moe_forward(small, p.x, p.weights);

  show_gradient_products(writer);
  const bool walks_ok = show_transpose_walk(writer, small, forward);
  const double products_error = show_backward_products(writer, small, p, forward);

  const MoeConfig medium = medium_config();
  Problem q = make_problem(medium, 200, options.seed + 10);
  const double paths_error = compare_expert_paths(writer, p, q);
  const ref::LayerForward fq = ref::moe_forward(medium, q.x, q.weights);
  const ref::LayerGradients gq = ref::moe_backward(medium, q.x, q.weights, fq, q.dy, ref::ExpertPath::block_sparse);
  const double fd_error = show_finite_differences(writer, medium, q, fq, gq);
  const double split_error = show_router_terms(writer, medium, q, fq, gq);

  const bool pass = walks_ok && products_error < 1e-12 && paths_error < 1e-12 && fd_error < 1e-6 && split_error < 1e-12;
  std::ostringstream message;
  message << std::setprecision(2) << "transpose walks top to bottom: " << (walks_ok ? "yes" : "NO")
          << "; backward products vs dense rel_err=" << products_error << " block-sparse vs per-expert rel_err="
          << paths_error << " tol=1e-12; finite differences rel_err=" << fd_error << " tol=1e-6";

  // ---- 5. the GPU ----
  const lessons::GpuPart gpu = gpu_gradient_check(writer, options.seed);
  return lessons::finish_with_gpu_part(writer, "lesson04_backward", options, pass, message.str(), gpu);
}
