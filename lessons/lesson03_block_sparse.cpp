// lesson03_block_sparse.cpp: Lesson 03, block-sparse matrix products (MegaBlocks, Gale et al.,
// MLSys 2023). The dropless expert computation drawn for a small case: the hidden matrix in B x B
// blocks, its BCSR arrays and their transpose, the same tokens as the padded and dropping
// formulations would compute them, then SDD and DSD shown equal to the masked dense products,
// small enough that every index a kernel reads can be followed by hand.
// Where a GPU is present, the GPU's block-sparse FFN forward is checked against the CPU reference.
// Read lessons/03_block_sparse.md.
//
// Build and run:  ./moe build && build/lessons/lesson03_block_sparse [--out runs/lesson03_block_sparse]
//
// The CPU part runs the CPU reference (moe::ref, double precision). The GPU part is compiled only
// when CMake found CUDA (MOE_LESSON_HAS_CUDA) and runs only when a GPU is present.
// Dimension legend: T tokens, D model width, H expert hidden width, E experts, K top-k,
// C capacity, B block size.
#include <cmath>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "reference_cpu/block_sparse.h"  // moe::ref::sdd, dsd, sparse_to_dense
#include "block_sparse_ffn.h"            // concat_expert_columns, concat_expert_rows, block_sparse_ffn_forward
#include "expert_ffn.h"                  // gelu
#include "init.h"                        // random_weights
#include "lesson_support.h"              // options, zipf_tokens, Table
#include "reference_cpu/moe_layer.h"     // moe_forward

#ifdef MOE_LESSON_HAS_CUDA
#include "moe/block_sparse.h"       // moe::cuda::block_sparse_ffn_forward
#include "core/bf16.h"              // bf16, to_bf16
#include "bridge/reference_topology.h"  // upload_topology
#include "core/cuda_check.h"        // CUDA_CHECK
#include "core/device_buffer.h"     // DeviceBuffer
#include "core/device_info.h"       // gpu_available, why_no_gpu, current_device
#endif

using namespace moe;
using moe::lessons::Table;
using moe::lessons::relative_error;
using moe::ref::Matrix;

namespace {

std::string join(const ref::IndexVector& values) {
  std::ostringstream text;
  for (size_t i = 0; i < values.size(); ++i) text << (i ? " " : "") << values[i];
  return text.str();
}

// ---- the pictures ----

// The hidden matrix [rows, E*H], one character per value: '#' computed for a token, 'o' computed
// for a padding row (a wasted row of a block), '.' never computed (outside every block). '|' and
// '-' mark the block edges.
void draw_hidden_matrix(const MoeConfig& config, const ref::DispatchPlan& plan,
                        const ref::BlockSparseTopology& topology) {
  const int64_t B = topology.block_size;
  std::set<std::pair<int32_t, int32_t>> blocks;  // (block row, block column) of every stored block
  for (int64_t i = 0; i < topology.nnz; ++i) blocks.insert({topology.row_indices[i], topology.column_indices[i]});
  const std::string rule = "  " + std::string(22, ' ') + std::string(topology.cols() + topology.block_cols - 1, '-');

  std::cout << "\nThe hidden matrix [rows=" << topology.rows() << ", E*H=" << topology.cols() << "] in "
            << B << " x " << B << " blocks ('#' a token's value, 'o' a padding row inside a block, '.' not"
            << " computed):\n";
  for (int64_t r = 0; r < topology.rows(); ++r) {
    const int64_t block_row = r / B;
    if (r > 0 && r % B == 0) std::cout << rule << "\n";
    const int32_t slot = plan.row_slot[r];
    std::ostringstream label;
    label << "row " << std::setw(2) << r << "  e" << topology.block_row_expert[block_row] << "  ";
    if (slot >= 0) label << "tok " << std::setw(2) << slot / config.top_k;
    else label << "pad   ";
    std::cout << "  " << std::left << std::setw(22) << label.str() << std::right;
    for (int64_t c = 0; c < topology.cols(); ++c) {
      if (c > 0 && c % B == 0) std::cout << '|';
      const bool stored = blocks.count({static_cast<int32_t>(block_row), static_cast<int32_t>(c / B)}) > 0;
      std::cout << (!stored ? '.' : slot >= 0 ? '#' : 'o');
    }
    if (r % B == 0) {
      std::cout << "   block row " << block_row << ": blocks " << topology.offsets[block_row] << ".."
                << topology.offsets[block_row + 1] - 1;
    }
    std::cout << "\n";
  }
}

// The same grid one cell per block: the block's id in BCSR order, '.' where no block is stored.
Table block_id_grid(const ref::BlockSparseTopology& topology) {
  std::vector<std::string> columns = {"block row (expert)"};
  for (int64_t c = 0; c < topology.block_cols; ++c) columns.push_back("col " + std::to_string(c));
  Table grid("Block ids in BCSR order (row-major); '.' = no block", columns);
  for (int64_t r = 0; r < topology.block_rows; ++r) {
    std::vector<nlohmann::json> row = {std::to_string(r) + " (e" + std::to_string(topology.block_row_expert[r]) + ")"};
    for (int64_t c = 0; c < topology.block_cols; ++c) row.push_back(".");
    for (int32_t i = topology.offsets[r]; i < topology.offsets[r + 1]; ++i) {
      row[topology.column_indices[i] + 1] = std::to_string(i);
    }
    grid.add_row(row);
  }
  return grid;
}

// One expert's rows as characters: '#' a token computed, 'o' a padding row computed, 'x' a token
// dropped (never computed).
std::string rows_picture(int64_t computed_tokens, int64_t padding, int64_t dropped) {
  return std::string(computed_tokens, '#') + std::string(padding, 'o') + std::string(dropped, 'x');
}

#ifdef MOE_LESSON_HAS_CUDA
// ---- the GPU part: the block-sparse FFN forward on tensor cores against the CPU reference ----

constexpr double kGpuTolerance = 1e-2;  // bf16 operands and outputs, fp32 accumulation

Matrix round_bf16(const Matrix& m) {
  return m.unaryExpr([](double v) { return double(__bfloat162float(__float2bfloat16(float(v)))); });
}

// Relative Frobenius error of the first reference.size() values of a bf16 download.
std::pair<double, int64_t> compare(const std::vector<cuda::bf16>& gpu, const Matrix& reference) {
  double diff = 0, norm = 0;
  int64_t not_finite = 0;
  for (int64_t i = 0; i < reference.size(); ++i) {
    const double g = __bfloat162float(gpu[size_t(i)]);
    not_finite += !std::isfinite(g);
    diff += (g - reference.data()[i]) * (g - reference.data()[i]);
    norm += reference.data()[i] * reference.data()[i];
  }
  return {std::sqrt(diff / norm), not_finite};
}

lessons::GpuPart gpu_forward_check(RunWriter& writer, uint64_t seed) {
  if (!cuda::gpu_available()) return lessons::skip_gpu_part(cuda::why_no_gpu());
  MoeConfig config;
  config.tokens = 2048;     // T
  config.model_dim = 256;   // D
  config.hidden_dim = 512;  // H
  config.num_experts = 8;   // E
  config.top_k = 2;         // K
  config.block_size = 64;   // B: the GPU kernels take 64 or 128
  config.formulation = Formulation::dropless;
  const int64_t D = config.model_dim, E = config.num_experts, B = config.block_size;

  // The CPU reference routes and plans; the GPU gets exactly its topology (upload_topology) and
  // computes from exactly its bf16-rounded inputs, so only the arithmetic differs.
  std::mt19937_64 generator(seed + 100);
  const Matrix x = round_bf16(lessons::zipf_tokens(config.tokens, D, 1000, 1.1, generator));
  ref::MoeWeights weights = ref::random_weights(config, seed + 101);
  weights.gate_weights *= 3.0;
  for (auto& w : weights.w1) w = round_bf16(w);
  for (auto& w : weights.w2) w = round_bf16(w);
  const ref::LayerForward forward = ref::moe_forward(config, x, weights);
  const ref::BlockSparseTopology& topology = *forward.topology;
  const ref::BlockSparseActivations reference =
      ref::block_sparse_ffn_forward(config, topology, forward.permuted_x, weights.w1, weights.w2);

  const int64_t rows = forward.plan.total_rows;
  const int64_t max_rows = config.tokens * config.top_k + E * (B - 1);  // the plan's host bound
  cuda::UploadedTopology device_topology = cuda::upload_topology(topology, config.hidden_dim, max_rows);
  const size_t block_values = size_t(device_topology.topology.max_nnz) * B * B;

  // Inputs and outputs poisoned past the used part: NaN in, NaN left where nothing may be written.
  std::vector<cuda::bf16> x_host(size_t(max_rows * D), __float2bfloat16(NAN));
  for (int64_t i = 0; i < forward.permuted_x.size(); ++i) x_host[size_t(i)] = __float2bfloat16(float(forward.permuted_x.data()[i]));
  cuda::DeviceBuffer<cuda::bf16> permuted_x(x_host);
  std::vector<cuda::DeviceBuffer<cuda::bf16>> w1, w2;
  std::vector<const cuda::bf16*> w1_pointers, w2_pointers;
  for (int64_t e = 0; e < E; ++e) {
    w1.emplace_back(cuda::to_bf16(weights.w1[e].data(), size_t(weights.w1[e].size())));
    w2.emplace_back(cuda::to_bf16(weights.w2[e].data(), size_t(weights.w2[e].size())));
    w1_pointers.push_back(w1.back().data());
    w2_pointers.push_back(w2.back().data());
  }
  cuda::DeviceBuffer<const cuda::bf16*> w1_table(w1_pointers), w2_table(w2_pointers);
  cuda::DeviceBuffer<cuda::bf16> pre(block_values), hidden(block_values), out(size_t(max_rows * D));
  for (auto* buffer : {&pre, &hidden, &out}) buffer->fill_bytes(0xFF);

  cuda::block_sparse_ffn_forward(config, device_topology.topology, permuted_x.data(), w1_table.data(),
                                 w2_table.data(), {pre.data(), nullptr, hidden.data(), out.data()});
  CUDA_CHECK(cudaDeviceSynchronize());

  Table table("Table 4: GPU block-sparse FFN forward (bf16, tensor cores) vs the CPU reference (double)",
              {"tensor", "shape", "what", "rel err", "tol", "non-finite"});
  bool pass = true;
  std::ostringstream message;
  const std::vector<std::tuple<std::string, std::string, std::string, std::vector<cuda::bf16>, const Matrix*>>
      checks = {
          {"pre_activation", "[nnz*B, B]", "SDD(x, W1cat) blocks", pre.download(), &reference.pre_activation},
          {"hidden", "[nnz*B, B]", "GeLU fused in SDD's epilogue", hidden.download(), &reference.hidden},
          {"out", "[rows, D]", "DSD(hidden, W2cat)", out.download(), &forward.expert_out},
      };
  for (const auto& [name, shape, what, values, expected] : checks) {
    const auto [error, not_finite] = compare(values, *expected);
    pass = pass && error < kGpuTolerance && not_finite == 0;
    table.add_row({name, shape, what, error, kGpuTolerance, not_finite});
    message << " " << name << "=" << std::scientific << std::setprecision(1) << error;
  }
  const std::string device = cuda::current_device().name;
  std::cout << "\nGPU part on " << device << ": T=" << config.tokens << " D=" << D << " H=" << config.hidden_dim
            << " E=" << E << " K=" << config.top_k << " B=" << B << ", rows=" << rows << ", nnz=" << topology.nnz
            << " blocks\n";
  lessons::show(writer, table);
  std::cout << "  For the kernel versions (naive, shared-memory tiles, mma.sync tensor cores) and their\n"
               "  % of cuBLAS, build and run: cmake --build build --target dev_sdd && build/cuda/dev/dev_sdd\n";
  return {pass, "GPU FFN forward rel_err" + message.str() + " tol=1e-2"};
}

// The run record's GPU, where one is present.
std::string gpu_name() { return cuda::gpu_available() ? cuda::current_device().name : ""; }
#else
lessons::GpuPart gpu_forward_check(RunWriter&, uint64_t) { return lessons::skip_gpu_part_not_built(); }
std::string gpu_name() { return ""; }
#endif

// ---- 1. the topology, drawn ----

void show_topology(RunWriter& writer, const MoeConfig& config, const ref::LayerForward& forward) {
  const ref::DispatchPlan& plan = forward.plan;
  const ref::BlockSparseTopology& topology = *forward.topology;
  const int64_t B = config.block_size;
  draw_hidden_matrix(config, plan, topology);
  const Table grid = block_id_grid(topology);
  lessons::show(writer, grid);

  Table arrays("Table 1: the BCSR arrays of this topology (MegaBlocks 5.1.4)", {"array", "length", "values"});
  arrays.add_row({"offsets", int64_t(topology.offsets.size()), join(topology.offsets)});
  arrays.add_row({"row_indices", int64_t(topology.row_indices.size()), join(topology.row_indices)});
  arrays.add_row({"column_indices", int64_t(topology.column_indices.size()), join(topology.column_indices)});
  arrays.add_row({"block_row_expert", int64_t(topology.block_row_expert.size()), join(topology.block_row_expert)});
  arrays.add_row({"block_row_tokens", int64_t(topology.block_row_tokens.size()), join(topology.block_row_tokens)});
  arrays.add_row({"column_offsets", int64_t(topology.column_offsets.size()), join(topology.column_offsets)});
  arrays.add_row({"transpose_indices", int64_t(topology.transpose_indices.size()), join(topology.transpose_indices)});
  lessons::show(writer, arrays);
  std::cout << "  offsets[r]..offsets[r+1]-1 are the ids of block row r's blocks; row_indices and\n"
               "  column_indices say where block i sits. column_offsets and transpose_indices list the\n"
               "  same ids column by column: column c's blocks, top to bottom, are\n"
               "  transpose_indices[column_offsets[c] .. column_offsets[c+1]-1] (lesson 04 walks them).\n";

  std::vector<int64_t> rows_per_expert(plan.rows_per_expert.begin(), plan.rows_per_expert.end());
  writer.append(to_event(TopologyEvent{.step = 0, .layer = 0, .block_size = B,
                                       .block_rows = topology.block_rows, .block_cols = topology.block_cols,
                                       .nnz = topology.nnz, .padding_rows = plan.padding_rows,
                                       .rows_per_expert = rows_per_expert}));
  writer.append(to_event(RoutingEvent{.step = 0, .layer = 0,
                                      .tokens_per_expert = {plan.tokens_per_expert.begin(), plan.tokens_per_expert.end()},
                                      .dropped_per_expert = {}, .capacity = std::nullopt,
                                      .tokens_per_expert_by_genre = {}}));
}

// ---- 2. the same tokens in the other formulations ----

struct OtherFormulations {
  ref::LayerForward dropping, padded;
};

OtherFormulations run_other_formulations(const MoeConfig& config, const Matrix& x, const ref::MoeWeights& weights) {
  MoeConfig dropping_config = config;
  dropping_config.formulation = Formulation::dropping;
  OtherFormulations other;
  other.dropping = ref::moe_forward(dropping_config, x, weights);
  MoeConfig padded_config = config;
  padded_config.formulation = Formulation::padded;
  other.padded = ref::moe_forward(padded_config, x, weights);
  return other;
}

void show_formulations(RunWriter& writer, const MoeConfig& config, const ref::LayerForward& forward,
                       const OtherFormulations& other) {
  const ref::DispatchPlan& plan = forward.plan;
  const ref::LayerForward& dropping = other.dropping;
  const ref::LayerForward& padded = other.padded;
  const int64_t E = config.num_experts, B = config.block_size;
  const int64_t C = dropping.plan.capacity;

  Table formulations("Table 2: the same routed tokens, per expert ('#' token computed, 'o' padding row "
                     "computed, 'x' token dropped); capacity factor 1.0, C = " + std::to_string(C),
                     {"expert", "tokens", "dropless (B=" + std::to_string(B) + ")", "dropping", "padded"});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = plan.tokens_per_expert[e], kept = dropping.plan.kept_per_expert[e];
    formulations.add_row({e, n, rows_picture(n, plan.rows_per_expert[e] - n, 0),
                          rows_picture(kept, 0, n - kept), rows_picture(kept, C - kept, n - kept)});
  }
  const int64_t routed = config.tokens * config.top_k;
  formulations.add_row({"rows", routed, plan.total_rows, dropping.plan.total_rows, padded.plan.total_rows});
  formulations.add_row({"dropped", 0, int64_t(0), dropping.plan.dropped_slots, padded.plan.dropped_slots});
  formulations.add_row({"rel err of y vs dropless", "", 0.0, relative_error(dropping.y, forward.y),
                        relative_error(padded.y, forward.y)});
  lessons::show(writer, formulations);
  std::cout << "  Dropless computes every token and pads each expert to a multiple of B; dropping computes\n"
               "  at most C rows per expert and loses the rest; padded computes exactly C rows per expert.\n";
}

// ---- 3. SDD and DSD against the masked dense products ----

struct ProductErrors {
  double sdd = 0, dsd = 0, per_expert = 0;  // relative, against the masked dense products and expert_ffn
};

// The block-diagonal structure is the whole trick: W1cat = [w1[0] | w1[1] | ...] makes x W1cat the
// product of every row with every expert; the topology keeps only the blocks of the row's own
// expert, and SDD computes those blocks alone.
ProductErrors show_block_products(RunWriter& writer, const MoeConfig& config, const ref::MoeWeights& weights,
                                  const ref::LayerForward& forward) {
  const ref::BlockSparseTopology& topology = *forward.topology;
  const int64_t E = config.num_experts, B = config.block_size;
  const int64_t H = config.hidden_dim;
  const Matrix w1_cat = ref::concat_expert_columns(weights.w1, 0, H);  // [D, E*H]
  const Matrix w2_cat = ref::concat_expert_rows(weights.w2);           // [E*H, D]
  const Matrix dense_pre = forward.permuted_x * w1_cat;                // [rows, E*H], all of it
  const Matrix masked_pre = ref::sparse_to_dense(topology, ref::dense_to_sparse(topology, dense_pre));
  const Matrix pre_blocks = ref::sdd(forward.permuted_x, w1_cat, topology);  // [nnz*B, B]
  const double sdd_error = relative_error(ref::sparse_to_dense(topology, pre_blocks), masked_pre);

  const Matrix hidden_blocks = pre_blocks.unaryExpr([](double a) { return ref::gelu(a); });
  const Matrix out = ref::dsd(topology, hidden_blocks, /*transpose_s=*/false, w2_cat);  // [rows, D]
  const Matrix dense_out = ref::sparse_to_dense(topology, hidden_blocks) * w2_cat;
  const double dsd_error = relative_error(out, dense_out);
  const double per_expert_error = relative_error(out, forward.expert_out);  // expert_ffn: one GEMM per expert

  const int64_t dense_madds = topology.rows() * topology.cols() * config.model_dim;
  const int64_t sparse_madds = topology.nnz * B * B * config.model_dim;
  Table products("Table 3: the block-sparse products on the CPU reference vs the masked dense products",
                 {"product", "computes", "multiply-adds (blocks)", "multiply-adds (dense)", "rel err", "against"});
  products.add_row({"SDD", "pre = x W1cat at the blocks", sparse_madds, dense_madds, sdd_error,
                    "mask(x W1cat), dense [rows, E*H]"});
  products.add_row({"DSD", "out = gelu(pre) W2cat", sparse_madds, dense_madds, dsd_error,
                    "dense(hidden) W2cat"});
  products.add_row({"DSD", "out = gelu(pre) W2cat", sparse_madds, sparse_madds, per_expert_error,
                    "one dense GEMM per expert (expert_ffn)"});
  lessons::show(writer, products);
  std::cout << "  The dense product computes every row against every expert: E = " << E
            << " times the useful work. The blocks\n  keep " << 100.0 * double(sparse_madds) / double(dense_madds)
            << "% of it, and pay only for the padding rows inside them.\n";
  return {sdd_error, dsd_error, per_expert_error};
}

}  // namespace

int main(int argc, char** argv) {
  const auto options =
      lessons::parse_options(argc, argv, "lesson03_block_sparse", "runs/lesson03_block_sparse");
  std::mt19937_64 generator(options.seed);

  // A case small enough to draw: 24 text-like tokens, 4 experts of hidden width 8, 4 x 4 blocks.
  const MoeConfig config = lessons::small_block_case();

  auto writer = lessons::create_lesson_run(options, "lesson03_block_sparse", "03", config, lessons::cpu_and_gpu_devices(gpu_name()));

  std::cout << "Lesson 03: block-sparse matrix products. T=" << config.tokens << " text-like tokens, D="
            << config.model_dim << ", H=" << config.hidden_dim << ", E=" << config.num_experts
            << ", K=" << config.top_k << ", B=" << config.block_size << "\n";

  const Matrix x = lessons::zipf_tokens(config.tokens, config.model_dim, 12, 1.1, generator);  // [T, D]
  ref::MoeWeights weights = ref::random_weights(config, options.seed + 1);
  weights.gate_weights *= 3.0;  // a confident router: real skew, as in lesson 02
  const ref::LayerForward forward = ref::moe_forward(config, x, weights);

  show_topology(writer, config, forward);
  const OtherFormulations other = run_other_formulations(config, x, weights);
  show_formulations(writer, config, forward, other);
  const ProductErrors errors = show_block_products(writer, config, weights, forward);

  const bool pass = errors.sdd < 1e-12 && errors.dsd < 1e-12 && errors.per_expert < 1e-12 &&
                    relative_error(other.dropping.y, other.padded.y) < 1e-12;
  std::ostringstream message;
  message << std::setprecision(2) << "CPU SDD rel_err=" << errors.sdd << " DSD rel_err=" << errors.dsd
          << " vs per-expert=" << errors.per_expert << " tol=1e-12";

  // ---- 4. the GPU ----
  const lessons::GpuPart gpu = gpu_forward_check(writer, options.seed);
  return lessons::finish_with_gpu_part(writer, "lesson03_block_sparse", options, pass, message.str(), gpu);
}
