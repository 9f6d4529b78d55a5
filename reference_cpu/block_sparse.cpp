// block_sparse.cpp: SDD, DSD, DDS on a block-sparse topology (see block_sparse.h).
// Written block by block, the way a GPU kernel walks them, not as masked dense products.
#include "block_sparse.h"

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace moe::ref {

namespace {

void expect(bool ok, std::string_view function, std::string_view argument, const Matrix& m,
            std::string_view wanted) {
  if (ok) return;
  std::ostringstream message;
  message << function << ": " << argument << " has shape [" << m.rows() << ", " << m.cols()
          << "]; expected " << wanted;
  throw std::invalid_argument(message.str());
}

// Built with a stream: GCC 12 warns falsely (-Wrestrict) on "literal" + std::to_string(...).
std::string with_shape(std::string_view legend, int64_t rows, int64_t cols) {
  std::ostringstream text;
  text << legend << " = [" << rows << ", " << cols << "]";
  return text.str();
}

std::string with(std::string_view legend, int64_t value) {
  std::ostringstream text;
  text << legend << " = " << value;
  return text.str();
}

void expect_blocks(std::string_view function, const BlockSparseTopology& topology,
                   const Matrix& s_blocks) {
  const int64_t B = topology.block_size;
  expect(s_blocks.rows() == topology.nnz * B && s_blocks.cols() == B, function, "s_blocks",
         s_blocks, with_shape("[nnz * B, B]", topology.nnz * B, B));
}

// The two orders a block-sparse product walks its blocks in, calling visit(block, r, c) for the
// block at block row r, block column c: row by row through offsets (the CSR order), or column by
// column through transpose_indices (the order the transposed GPU kernels read them in). Each
// output block sums its inputs in this order, as the kernels do.
template <typename Visit>
void for_each_block_by_row(const BlockSparseTopology& topology, Visit visit) {
  for (int64_t r = 0; r < topology.block_rows; ++r) {
    for (int64_t block = topology.offsets[r]; block < topology.offsets[r + 1]; ++block) {
      visit(block, r, topology.column_indices[block]);
    }
  }
}

template <typename Visit>
void for_each_block_by_column(const BlockSparseTopology& topology, Visit visit) {
  for (int64_t c = 0; c < topology.block_cols; ++c) {
    for (int64_t j = topology.column_offsets[c]; j < topology.column_offsets[c + 1]; ++j) {
      const int64_t block = topology.transpose_indices[j];
      visit(block, topology.row_indices[block], c);
    }
  }
}

}  // namespace

Matrix sdd(const Matrix& a, const Matrix& bm, const BlockSparseTopology& topology) {
  const int64_t B = topology.block_size;
  expect(a.rows() == topology.rows(), "sdd", "a", a, with("[M, Kd] with M", topology.rows()));
  expect(bm.rows() == a.cols() && bm.cols() == topology.cols(), "sdd", "bm", bm,
         with_shape("[Kd, N]", a.cols(), topology.cols()));
  Matrix out(topology.nnz * B, B);
  for (int64_t block = 0; block < topology.nnz; ++block) {
    const int64_t r = topology.row_indices[block], c = topology.column_indices[block];
    out.middleRows(block * B, B).noalias() = a.middleRows(r * B, B) * bm.middleCols(c * B, B);
  }
  return out;
}

Matrix dsd(const BlockSparseTopology& topology, const Matrix& s_blocks, bool transpose_s,
           const Matrix& bm) {
  const int64_t B = topology.block_size;
  expect_blocks("dsd", topology, s_blocks);
  if (!transpose_s) {
    // D[block row r] = sum over the blocks of row r: S_block * bm[block column]
    expect(bm.rows() == topology.cols(), "dsd", "bm", bm, with("[N, P] with N", topology.cols()));
    Matrix out = Matrix::Zero(topology.rows(), bm.cols());
    for_each_block_by_row(topology, [&](int64_t block, int64_t r, int64_t c) {
      out.middleRows(r * B, B).noalias() += s_blocks.middleRows(block * B, B) * bm.middleRows(c * B, B);
    });
    return out;
  }
  // Sᵀ: row block c of the output gathers the blocks of column c, found through transpose_indices.
  expect(bm.rows() == topology.rows(), "dsd", "bm", bm, with("[M, P] with M", topology.rows()));
  Matrix out = Matrix::Zero(topology.cols(), bm.cols());
  for_each_block_by_column(topology, [&](int64_t block, int64_t r, int64_t c) {
    out.middleRows(c * B, B).noalias() +=
        s_blocks.middleRows(block * B, B).transpose() * bm.middleRows(r * B, B);
  });
  return out;
}

Matrix dds(const Matrix& a, const BlockSparseTopology& topology, const Matrix& s_blocks,
           bool transpose_s) {
  const int64_t B = topology.block_size;
  expect_blocks("dds", topology, s_blocks);
  if (!transpose_s) {
    // D[:, block column c] = sum over the blocks of column c: a[:, block row] * S_block
    expect(a.cols() == topology.rows(), "dds", "a", a, with("[P, M] with M", topology.rows()));
    Matrix out = Matrix::Zero(a.rows(), topology.cols());
    for_each_block_by_column(topology, [&](int64_t block, int64_t r, int64_t c) {
      out.middleCols(c * B, B).noalias() += a.middleCols(r * B, B) * s_blocks.middleRows(block * B, B);
    });
    return out;
  }
  expect(a.cols() == topology.cols(), "dds", "a", a, with("[P, N] with N", topology.cols()));
  Matrix out = Matrix::Zero(a.rows(), topology.rows());
  for_each_block_by_row(topology, [&](int64_t block, int64_t r, int64_t c) {
    out.middleCols(r * B, B).noalias() += a.middleCols(c * B, B) * s_blocks.middleRows(block * B, B).transpose();
  });
  return out;
}

Matrix sparse_to_dense(const BlockSparseTopology& topology, const Matrix& s_blocks) {
  const int64_t B = topology.block_size;
  expect_blocks("sparse_to_dense", topology, s_blocks);
  Matrix dense = Matrix::Zero(topology.rows(), topology.cols());
  for (int64_t block = 0; block < topology.nnz; ++block) {
    dense.block(topology.row_indices[block] * B, topology.column_indices[block] * B, B, B) =
        s_blocks.middleRows(block * B, B);
  }
  return dense;
}

Matrix dense_to_sparse(const BlockSparseTopology& topology, const Matrix& dense) {
  const int64_t B = topology.block_size;
  expect(dense.rows() == topology.rows() && dense.cols() == topology.cols(), "dense_to_sparse",
         "dense", dense, with_shape("[M, N]", topology.rows(), topology.cols()));
  Matrix blocks(topology.nnz * B, B);
  for (int64_t block = 0; block < topology.nnz; ++block) {
    blocks.middleRows(block * B, B) =
        dense.block(topology.row_indices[block] * B, topology.column_indices[block] * B, B, B);
  }
  return blocks;
}

}  // namespace moe::ref
