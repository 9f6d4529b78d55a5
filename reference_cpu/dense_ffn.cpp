// dense_ffn.cpp: the dense GeLU FFN forward and backward (see dense_ffn.h).
#include "dense_ffn.h"

#include "expert_ffn.h"  // gelu, gelu_derivative: the same activation as the experts

namespace moe::ref {

DenseFfnForward dense_ffn_forward(const Matrix& x, const Matrix& w1, const Matrix& w2) {
  DenseFfnForward forward;
  forward.pre_activation = x * w1;
  forward.hidden = forward.pre_activation.unaryExpr([](double a) { return gelu(a); });
  forward.out = forward.hidden * w2;
  return forward;
}

DenseFfnGradients dense_ffn_backward(const Matrix& x, const Matrix& w1, const Matrix& w2,
                                     const DenseFfnForward& forward, const Matrix& d_out) {
  DenseFfnGradients grads;
  grads.w2 = forward.hidden.transpose() * d_out;
  const Matrix d_hidden = d_out * w2.transpose();
  const Matrix d_pre = d_hidden.cwiseProduct(
      forward.pre_activation.unaryExpr([](double a) { return gelu_derivative(a); }));
  grads.w1 = x.transpose() * d_pre;
  grads.x = d_pre * w1.transpose();
  return grads;
}

}  // namespace moe::ref
