// layer_norm.cpp: LayerNorm forward and backward (see layer_norm.h).
#include "layer_norm.h"

#include <cmath>

namespace moe::ref {

LayerNormForward layer_norm_forward(const Matrix& x, const Matrix& gain, const Matrix& bias, double eps) {
  const Eigen::Index T = x.rows();
  const double D = static_cast<double>(x.cols());
  LayerNormForward out;
  out.x_hat.resize(T, x.cols());
  out.rstd.resize(T);
  for (Eigen::Index t = 0; t < T; ++t) {
    const double mean = x.row(t).sum() / D;
    const auto centred = (x.row(t).array() - mean).matrix();
    const double variance = centred.squaredNorm() / D;
    out.rstd(t) = 1.0 / std::sqrt(variance + eps);
    out.x_hat.row(t) = centred * out.rstd(t);
  }
  out.y = (out.x_hat.array().rowwise() * gain.row(0).array()).matrix();
  out.y.rowwise() += bias.row(0);
  return out;
}

LayerNormGradients layer_norm_backward(const LayerNormForward& forward, const Matrix& gain, const Matrix& dy) {
  const Eigen::Index T = dy.rows();
  const double D = static_cast<double>(dy.cols());
  LayerNormGradients grads;
  grads.gain = dy.cwiseProduct(forward.x_hat).colwise().sum();
  grads.bias = dy.colwise().sum();
  grads.x.resize(T, dy.cols());
  for (Eigen::Index t = 0; t < T; ++t) {
    const Eigen::RowVectorXd g = dy.row(t).cwiseProduct(gain.row(0));
    const double mean_g = g.sum() / D;
    const double mean_g_xhat = g.dot(forward.x_hat.row(t)) / D;
    grads.x.row(t) = forward.rstd(t) *
                     ((g.array() - mean_g).matrix() - mean_g_xhat * forward.x_hat.row(t));
  }
  return grads;
}

}  // namespace moe::ref
