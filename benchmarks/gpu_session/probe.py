"""GPU smoke test for the carried TensorFlow: devices, matmul, conv (cuDNN), LSTM (cuDNN), an XLA function."""
import time
import tensorflow as tf
print("TF", tf.__version__, tf.sysconfig.get_build_info()["cuda_version"], flush=True)
gpus = tf.config.list_physical_devices("GPU")
print("GPUs:", gpus, flush=True)
if gpus:
    print(tf.config.experimental.get_device_details(gpus[0]), flush=True)

def timed(label, fn, flops, reps=10):
    fn(); r = fn(); _ = r.numpy() if hasattr(r, "numpy") else r
    t = time.perf_counter()
    for _ in range(reps):
        r = fn()
    _ = float(tf.reduce_sum(tf.cast(r, tf.float32)))
    dt = (time.perf_counter() - t) / reps
    print(f"{label}: {dt * 1e3:.3f} ms, {flops / dt / 1e12:.1f} TFLOP/s", flush=True)

dev = "/GPU:0" if gpus else "/CPU:0"
with tf.device(dev):
    n = 8192
    a, b = tf.random.normal((n, n)), tf.random.normal((n, n))
    timed("matmul f32 (TF32 on) 8192^3", lambda: tf.matmul(a, b), 2 * n ** 3)
    ab, bb = tf.cast(a, tf.bfloat16), tf.cast(b, tf.bfloat16)
    timed("matmul bf16 8192^3", lambda: tf.matmul(ab, bb), 2 * n ** 3)
    x = tf.random.normal((64, 56, 56, 256)); k = tf.random.normal((3, 3, 256, 256))
    timed("conv2d 3x3 64x56x56x256", lambda: tf.nn.conv2d(x, k, 1, "SAME"), 2 * 64 * 56 * 56 * 256 * 256 * 9)
    jit = tf.function(lambda u: tf.reduce_sum(tf.nn.relu(tf.matmul(u, u))), jit_compile=True)
    timed("XLA matmul+relu+sum 8192^3", lambda: jit(a), 2 * n ** 3)
    import keras
    lstm = keras.layers.LSTM(1024)
    seq = tf.random.normal((64, 22, 300))
    mask = tf.sequence_mask(tf.random.uniform((64,), 1, 23, dtype=tf.int32), 22)
    timed("keras LSTM 300->1024 x22 (masked)", lambda: lstm(seq, mask=mask), 2 * 22 * 64 * 4 * 1024 * (300 + 1024))
print("probe done", flush=True)
