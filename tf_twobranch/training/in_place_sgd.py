"""SGD with momentum whose update runs in place: Keras' formula, no full-size temporaries.

Keras' `SGD.update_step` writes the momentum update as three tensor ops
(`m * momentum`, `g * lr`, their difference) and then adds `m` to the
variable. Each op allocates a tensor of the variable's size, and TensorFlow's
executor keeps them until the assignment. For most layers that is nothing;
for the dual path's shared classifier W_share (2,048 × one class per training
image: 928 MB at COCO's 113,287 classes) those temporaries are most of the
model's growth with the number of images.

`InPlaceSGD` runs the same update through TensorFlow's fused training kernel
(`ResourceApplyKerasMomentum`), which computes, element by element and in
place,

    accum = accum * momentum - grad * lr
    var  += accum                                   (Nesterov: var += accum * momentum - grad * lr)

— Keras' formula, with the same float32 operations in the same order
(`tests/core/training/test_in_place_sgd.py` checks bit equality with `keras.optimizers.SGD`
over several steps, with and without Nesterov and weight decay). Gradients
that are `IndexedSlices` (an embedding's), other dtypes than the variable's,
and plain SGD (momentum 0) take Keras' own update unchanged.
"""
from __future__ import annotations

import keras
import tensorflow as tf


def _resource_handle(variable):
    """The resource handle of a TensorFlow variable as the optimizer sees it, or None.

    Under a `tf.distribute` strategy the update function receives the local
    component, whose `handle` is that replica's copy.
    """
    if isinstance(variable, keras.Variable):
        variable = variable.value
    try:
        handle = variable.handle
    except (AttributeError, ValueError):
        return None
    return handle if getattr(handle, "dtype", None) == tf.resource else None


@keras.saving.register_keras_serializable(package="tf_twobranch")
class InPlaceSGD(keras.optimizers.SGD):
    """`keras.optimizers.SGD` whose momentum update is one in-place kernel (same values)."""

    def update_step(self, gradient, variable, learning_rate):
        # (a gradient of another backend is no tf.Tensor either)
        if self.momentum == 0 or not isinstance(gradient, tf.Tensor) or gradient.dtype != variable.dtype:
            return super().update_step(gradient, variable, learning_rate)
        accumulator = self.momentums[self._get_variable_index(variable)]
        var_handle, accum_handle = _resource_handle(variable), _resource_handle(accumulator)
        if var_handle is None or accum_handle is None:
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=var_handle, accum=accum_handle, lr=tf.cast(learning_rate, dtype), grad=gradient,
            momentum=tf.cast(self.momentum, dtype), use_locking=False, use_nesterov=bool(self.nesterov))
