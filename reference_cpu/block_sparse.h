// block_sparse.h: reference block-sparse products on a BlockSparseTopology, one oracle per future
// GPU kernel (MegaBlocks 5.1: SDD, DSD, DDS, with transposes read through transpose_indices).
// Part of the CPU reference (moe::ref); built into moe_reference_cpu, tested by tests/reference_cpu.
//
// A sparse matrix S [M, N] (M = topology.rows(), N = topology.cols()) is stored as its nnz B x B
// blocks in BCSR order, stacked into one Matrix [nnz * B, B]: block i is rows i*B .. i*B + B - 1.
// Naming follows the papers: the letters say which operands are Dense or Sparse, output first.
//   sdd : S = A Bm, computed only at the topology's blocks   (the first expert layer, forward)
//   dsd : D = S Bm, or D = Sᵀ Bm with transpose_s            (the second expert layer; weight grads)
//   dds : D = A S,  or D = A Sᵀ with transpose_s             (weight gradients)
#pragma once

#include "topology.h"  // BlockSparseTopology
#include "types.h"

namespace moe::ref {

Matrix sdd(const Matrix& a,   // [M, Kd]
           const Matrix& bm,  // [Kd, N]
           const BlockSparseTopology& topology);  // -> blocks [nnz*B, B] of (a bm)

Matrix dsd(const BlockSparseTopology& topology,
           const Matrix& s_blocks,  // [nnz*B, B], S is [M, N]
           bool transpose_s,
           const Matrix& bm);  // [N, P] (or [M, P] if transposed) -> [M, P] (or [N, P])

Matrix dds(const Matrix& a,  // [P, M] (or [P, N] if transposed)
           const BlockSparseTopology& topology,
           const Matrix& s_blocks,  // [nnz*B, B], S is [M, N]
           bool transpose_s);       // -> [P, N] (or [P, M])

// Dense [M, N] with zeros outside the topology's blocks.
Matrix sparse_to_dense(const BlockSparseTopology& topology, const Matrix& s_blocks);
// The blocks of dense [M, N] that the topology keeps (everything else is discarded).
Matrix dense_to_sparse(const BlockSparseTopology& topology, const Matrix& dense);

}  // namespace moe::ref
