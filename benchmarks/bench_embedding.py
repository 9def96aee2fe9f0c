"""Benchmark of the two-branch embedding network: training step and evaluation.

Run from the repository root:

    python -m benchmarks.bench_embedding [--out_json benchmarks/results/embedding.json]

Prints, in one run:

0. the machine (CPU, cores, AVX-512, TF version, load average — the machine
   may be shared, so every training figure is also compared with a matmul
   figure measured in the same subprocess right before it);
1. float32 `tf.matmul` throughput (square and training-step shapes);
2. (a) the paper-size training step (4096/6000 → 2048 → 512, 500 images ×
   2 sentences) through Keras' compiled train function — s/step, pairs/s,
   GFLOP/s and the fraction of the matmul throughput — for jit_compile on/off
   and a fixed in-memory batch vs the tf.data input pipeline, plus a
   breakdown of where the step's time goes and measured candidate changes;
3. (b) evaluation (`retrieval_metrics`, both directions, R@1/5/10, medr,
   meanr) at MSCOCO-5K scale: time, peak memory, scaling with images ×
   captions and chunk size, and a naive full-matrix `recall_k` for
   comparison.

Every measurement runs in a fresh spawn subprocess (see `benchmarks.common`).
Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from benchmarks import common

# Paper-size embedding network and batch (TPAMI §5.1, the original code).
PAPER_MODEL = dict(image_dim=4096, text_dim=6000, image_hidden=(2048,), text_hidden=(2048,),
                   embed_dim=512)
NUM_IMAGES, SAMPLE_SIZE = 500, 2
NUM_TEXTS = NUM_IMAGES * SAMPLE_SIZE
EVAL_DIM = 512
CAPTIONS_PER_IMAGE = 5

TARGET_FRACTION = 0.90
TARGET_EVAL_SECONDS = 1.0
TARGET_EVAL_BYTES = 1 * 1024 ** 3


def _quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# --- FLOP count ------------------------------------------------------------------

FLOP_FORMULA = (
    "FLOPs/step = Σ_dense [2·m·k·n (forward) + 2·m·k·n (dW) + 2·m·k·n (dX, not for the "
    "first layer of a branch: inputs are not trainable)] + Σ_dist 3·2·m·n·d (distance "
    "matmuls, forward + both input gradients); dense: image 500×4096→2048→512, text "
    "1000×6000→2048→512; dist: text–image 1000×500×512, text–text 1000×1000×512. "
    "Not counted: the label matmul 1000×500×1000 of the text-neighbour mask (no gradient), "
    "batch norm, ReLU, dropout, L2-norm, top-k, Adam.")


def step_flops(image_dim=4096, text_dim=6000, hidden=2048, embed=512,
               num_images=NUM_IMAGES, num_texts=NUM_TEXTS, text_neighbours=True) -> dict:
    """Analytic matmul FLOPs of one training step of the embedding network."""
    def dense(m, dims):
        fwd = bwd = 0.0
        for i, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
            f = 2.0 * m * k * n
            fwd += f
            bwd += f if i == 0 else 2 * f   # first layer: dW only
        return fwd, bwd
    img_f, img_b = dense(num_images, [image_dim, hidden, embed])
    txt_f, txt_b = dense(num_texts, [text_dim, hidden, embed])
    dist = 3 * 2.0 * num_texts * num_images * embed
    if text_neighbours:
        dist += 3 * 2.0 * num_texts * num_texts * embed
    total = img_f + img_b + txt_f + txt_b + dist
    return {"dense_forward": img_f + txt_f, "dense_backward": img_b + txt_b,
            "distance": dist, "total": total,
            "label_matmul_not_counted": 2.0 * num_texts * num_images * num_texts}


# --- training step (subprocess) ----------------------------------------------

def _quick_matmul_gflops(tf, seconds=0.6):
    """Same-process float32 matmul figure (4096², median of 3 blocks)."""
    a = tf.random.stateless_normal([4096, 4096], seed=[1, 2])
    tf.matmul(a, a)
    rates = []
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            c = tf.matmul(a, a)
            n += 1
        _ = c.shape
        rates.append(2.0 * 4096 ** 3 * n / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


# Paper sizes of the models of the two-branch paper (TPAMI §5.1, §5.3), and the
# smallest sizes exercising the same code (smoke tests). Batch: `num_images`
# images x `sample_size` sentences each (embedding, LSTM); the similarity
# network takes num_images x sample_size positive pairs plus as many negatives.
PAPER_SIZES = dict(image_dim=4096, text_dim=6000, hidden=2048, embed=512, num_images=NUM_IMAGES,
                   sample_size=SAMPLE_SIZE, vocabulary_size=20074, max_len=32, word_dim=256,
                   lstm_units=512, lstm_text_hidden=1024, similarity_head=(512, 256))
TOY_SIZES = dict(image_dim=16, text_dim=24, hidden=16, embed=8, num_images=12, sample_size=2,
                 vocabulary_size=30, max_len=8, word_dim=8, lstm_units=8, lstm_text_hidden=8,
                 similarity_head=(8, 4))
MODEL_KINDS = ("embedding", "similarity", "lstm")


def model_config(kind: str = "embedding", sizes: dict = PAPER_SIZES):
    """`TwoBranchConfig` of the embedding / similarity network or the LSTM text branch."""
    # TensorFlow modules only inside the functions that run (in the spawn children, after
    # _quiet_tf): the parent that selects and reports benchmarks never imports TensorFlow.
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig
    common_kw = dict(image_dim=sizes["image_dim"], image_hidden=(sizes["hidden"],),
                     embed_dim=sizes["embed"])
    if kind == "lstm":
        vocabulary = ["<pad>", "<unk>"] + [f"w{i}" for i in range(2, sizes["vocabulary_size"])]
        return TwoBranchConfig(**common_kw, text_dim=1, text_hidden=(sizes["lstm_text_hidden"],),
                               text_encoder="lstm", vocabulary=vocabulary,
                               max_len=sizes["max_len"], word_dim=sizes["word_dim"],
                               lstm_units=sizes["lstm_units"])
    return TwoBranchConfig(**common_kw, kind=kind, text_dim=sizes["text_dim"],
                           text_hidden=(sizes["hidden"],),
                           similarity_head=sizes["similarity_head"])


def examples_per_batch(kind: str = "embedding", sizes: dict = PAPER_SIZES) -> int:
    """Image-sentence pairs of one training batch (texts; pairs for the similarity network)."""
    texts = sizes["num_images"] * sizes["sample_size"]
    return 2 * texts if kind == "similarity" else texts


def _paper_batch(tf, seed=0, kind: str = "embedding", sizes: dict = PAPER_SIZES):
    rng = np.random.default_rng(seed)
    n_img, per = sizes["num_images"], sizes["sample_size"]
    n_txt = n_img * per
    if kind == "similarity":   # positives, then one negative (another image's caption) each
        labels = np.concatenate([np.ones(n_txt, np.int32), np.zeros(n_txt, np.int32)])
        return {"image": tf.constant(rng.standard_normal((2 * n_txt, sizes["image_dim"]), np.float32)),
                "text": tf.constant(rng.random((2 * n_txt, sizes["text_dim"]), np.float32)),
                "labels": tf.constant(labels)}
    if kind == "lstm":
        lengths = rng.integers(min(8, sizes["max_len"]), sizes["max_len"] + 1, size=n_txt)
        ids = np.zeros((n_txt, sizes["max_len"]), np.int32)
        for row, n in enumerate(lengths):
            ids[row, :n] = rng.integers(2, sizes["vocabulary_size"], size=n)
        text = tf.constant(ids)
    else:
        text = tf.constant(rng.random((n_txt, sizes["text_dim"]), np.float32))
    return {
        "image": tf.constant(rng.standard_normal((n_img, sizes["image_dim"]), np.float32)),
        "text": text,
        "labels": tf.constant(np.repeat(np.eye(n_img, dtype=bool), per, axis=0)),
    }


def _feature_dataset(num_images=2000, seed=0, sizes: dict = PAPER_SIZES):
    """`attach_features` over `image_sentence_batches` with random features."""
    # Imports TensorFlow: in the measuring child only (see model_config).
    from tf_twobranch.systems.two_branch.sampling import attach_features, image_sentence_batches
    rng = np.random.default_rng(seed)
    caption_image = np.repeat(np.arange(num_images), CAPTIONS_PER_IMAGE)
    image_features = rng.standard_normal((num_images, sizes["image_dim"]), np.float32)
    text_features = rng.random((len(caption_image), sizes["text_dim"]), np.float32)
    ds = image_sentence_batches(caption_image, num_images, batch_size=sizes["num_images"],
                                sample_size=sizes["sample_size"], seed=seed)
    ds = attach_features(ds, image_features, text_features)
    # The model only needs these keys; the index keys stay in the batch as in fit().
    return ds


def pipeline_child(batches: int = 30, warmup: int = 3, num_images: int = 2000,
                   sizes: dict = PAPER_SIZES) -> dict:
    """Batches/s of `image_sentence_batches` + `attach_features` alone (random features in RAM)."""
    _quiet_tf()
    iterator = iter(_feature_dataset(num_images=num_images, sizes=sizes))
    for _ in range(warmup):
        next(iterator)
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    seconds = time.perf_counter() - t0
    return {"batches": batches, "seconds": seconds, "batches_per_second": batches / seconds,
            "batch_shapes": {k: list(v.shape) for k, v in batch.items()},
            "batch_bytes": int(sum(v.numpy().nbytes for v in batch.values())),
            "gallery_images": num_images, "loadavg": os.getloadavg()[0]}


def _make_variant_model(variant: str, kind: str = "embedding", sizes: dict = PAPER_SIZES):
    """The package's model, or a copy with one candidate change to the step."""
    # TensorFlow in the measuring child only (see model_config).
    import tensorflow as tf
    from tf_twobranch.losses import common
    from tf_twobranch.systems.two_branch import losses
    from tf_twobranch.systems.two_branch.model import TwoBranchModel

    config = model_config(kind, sizes)
    if variant != "package" and kind != "embedding":
        raise ValueError(f"variant {variant!r} exists for the embedding network only")
    if variant == "package":
        model = TwoBranchModel(config)
    elif variant == "xla_adam":
        class XlaAdam(TwoBranchModel):
            """Candidate: the package's step, with only the optimizer update XLA-compiled."""

            def train_step(self, data):
                if not hasattr(self, "_jit_apply"):
                    self._jit_apply = tf.function(
                        lambda g: self.optimizer.apply(g, self.trainable_variables),
                        jit_compile=True)
                with tf.GradientTape() as tape:
                    loss = self.objective(data, training=True)["loss"]
                    scaled = loss / tf.distribute.get_strategy().num_replicas_in_sync
                grads = tape.gradient(scaled, self.trainable_variables)
                self._jit_apply(grads)
                self.loss_tracker.update_state(loss)
                return {"loss": self.loss_tracker.result()}
        model = XlaAdam(config)
    else:
        class Variant(TwoBranchModel):
            def compute_task_loss(self, batch, training):
                out = self(batch, training=training)
                img, txt, labels = out["image_embedding"], out["text_embedding"], batch["labels"]
                if variant == "dense_only":   # towers only, trivial loss: the matmul floor
                    return tf.reduce_sum(img) + tf.reduce_sum(txt)
                if variant == "neighbours_from_ids":
                    return _loss_neighbours_from_ids(tf, losses, img, txt, labels, self.config)
                if variant == "static_shape_loss":
                    return static_shape_ranking_loss(img, txt, labels, **self.config.loss_kwargs())
                raise ValueError(variant)
        model = Variant(config)
    return model.build_all()


def _loss_neighbours_from_ids(tf, losses, img, txt, labels, config):
    """Candidate: text-neighbour mask from image ids instead of a float matmul.

    When every text has exactly one positive image (the paper's sampling),
    texts are neighbours iff their positive image is the same: an
    equality of argmax ids replaces the (T×I)·(I×T) label matmul.
    """
    kw = config.loss_kwargs()
    lw = kw.pop("text_neighbour_weight")
    loss = losses.bidirectional_ranking_loss(img, txt, labels, **kw, text_neighbour_weight=0.0)
    image_of_text = tf.argmax(tf.cast(labels, tf.int32), axis=1)
    nbrs = tf.equal(image_of_text[:, None], image_of_text[None, :])
    return loss + lw * losses.neighbourhood_loss(txt, nbrs, margin=kw["margin"],
                                                 top_k=kw["top_k"])


def static_shape_ranking_loss(image_embeds, text_embeds, labels, *, margin=0.05, top_k=10,
                              image_anchor_weight=1.0, text_anchor_weight=1.5,
                              image_neighbour_weight=0.0, text_neighbour_weight=0.05):
    """Candidate: `losses.bidirectional_ranking_loss` without data-dependent shapes.

    For a fixed anchor the positive term of the hinge [m + d(pos) − d(neg)]_+
    is the same for every negative, and clipping is monotone, so the K
    largest violations of every positive pair of text s are those of the K
    *closest negatives* of s, found once per text: top_k over (T×I) instead
    of gathering one row per positive pair with `tf.where(labels)` (whose
    dynamic shape XLA cannot compile: its gradient is a ScatterNd with a
    data-dependent shape). Same for image anchors over (I×T). Same value as
    the package's loss whenever every anchor has >= K negatives (also with
    several positives per row).
    """
    # TensorFlow in the measuring child only (see model_config).
    import tensorflow as tf
    from tf_twobranch.losses import common
    from tf_twobranch.systems.two_branch import losses
    labels = tf.cast(labels, tf.bool)
    labels_f = tf.cast(labels, tf.float32)
    dist = common.pairwise_distance(text_embeds, image_embeds)          # (T, I)
    far = tf.constant(-1e4, dist.dtype)  # hinge of a non-negative is clipped to 0

    def anchored(d, lab, lab_f):
        # d, lab: (anchors, candidates); rows are anchors, positives where lab.
        closest_neg = tf.math.top_k(tf.where(lab, far, -d), k=top_k).values   # (A, K) = −d(neg)
        hinge = tf.clip_by_value(margin + d[:, :, None] + closest_neg[:, None, :],
                                 0.0, common.HINGE_MAX)                         # (A, C, K)
        total = tf.reduce_sum(hinge * lab_f[:, :, None])
        return total / (tf.reduce_sum(lab_f) * top_k)

    loss = tf.constant(0.0, dist.dtype)
    if text_anchor_weight:
        loss += text_anchor_weight * anchored(dist, labels, labels_f)
    if image_anchor_weight:
        loss += image_anchor_weight * anchored(tf.transpose(dist), tf.transpose(labels),
                                               tf.transpose(labels_f))
    if text_neighbour_weight:
        text_nbrs = tf.matmul(labels_f, labels_f, transpose_b=True) > 0
        loss += text_neighbour_weight * losses.neighbourhood_loss(
            text_embeds, text_nbrs, margin=margin, top_k=top_k)
    if image_neighbour_weight:
        image_nbrs = tf.matmul(labels_f, labels_f, transpose_a=True) > 0
        image_nbrs = tf.logical_or(image_nbrs, tf.eye(tf.shape(labels)[1], dtype=tf.bool))
        loss += image_neighbour_weight * losses.neighbourhood_loss(
            image_embeds, image_nbrs, margin=margin, top_k=top_k)
    return loss


def _train_child(jit_compile: bool, input_path: str, variant: str, steps: int,
                 warmup: int, inter_op_threads: int | None, precision: str = "float32",
                 kind: str = "embedding", sizes: dict = PAPER_SIZES) -> dict:
    """Timed Keras train steps of one model (`kind`: embedding, similarity, lstm).

    `precision` is the Keras dtype policy the model is built under
    (`tf_twobranch.speed`); `input_path` "fixed" (one in-memory batch) or
    "tfdata" (the feature pipeline; embedding network only).
    """
    _quiet_tf()
    # TensorFlow after _quiet_tf, in the measuring child only (see model_config).
    import tensorflow as tf
    import keras
    from tf_twobranch.speed import precision_scope
    if inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    keras.utils.set_random_seed(0)
    with precision_scope(precision):
        model = _make_variant_model(variant, kind, sizes)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), jit_compile=jit_compile)
    model.optimizer.build(model.trainable_variables)
    model.make_train_function()
    if input_path == "fixed":
        batch = _paper_batch(tf, kind=kind, sizes=sizes)
        next_input = lambda: iter([batch])  # noqa: E731  (the non-tf.data branch of fit's function)
    else:
        iterator = iter(_feature_dataset(sizes=sizes))  # a tf.data.Iterator, as fit() uses
        next_input = lambda: iterator  # noqa: E731
    t0 = time.perf_counter()
    try:
        for _ in range(warmup):
            float(model.train_function(next_input())["loss"])
    except Exception as e:  # e.g. XLA cannot compile the step: report, don't abort
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
    warmup_seconds = time.perf_counter() - t0
    # Steps interleaved with a reference matmul, so both see the same load
    # from other processes on a shared machine.
    ref_n = 2048 if sizes["image_dim"] >= 1024 else 64   # toy sizes: a token matmul
    ref = tf.random.stateless_normal([ref_n, ref_n], seed=[1, 2])
    tf.matmul(ref, ref)
    times, mm_rates = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        float(model.train_function(next_input())["loss"])   # float() waits for the step
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(3):
            c = tf.matmul(ref, ref)
        _ = c.shape
        mm_rates.append(3 * 2.0 * ref_n ** 3 / (time.perf_counter() - t0) / 1e9)
    return {"step_seconds_median": statistics.median(times), "step_seconds_min": min(times),
            "step_seconds_all": times, "warmup_seconds": warmup_seconds,
            "kind": kind, "precision": precision,
            "examples_per_second": examples_per_batch(kind, sizes) / statistics.median(times),
            "trainable_parameters": sum(int(np.prod(v.shape)) for v in model.trainable_variables),
            "matmul_gflops_same_process": statistics.median(mm_rates),
            "matmul_gflops_same_process_all": mm_rates,
            "loadavg": os.getloadavg()[0]}


def _breakdown_child(jit_compile: bool, repeats: int) -> dict:
    """Where the step's time goes: forward, backward, optimizer, loss parts."""
    _quiet_tf()
    # TensorFlow after _quiet_tf, in the measuring child only (see model_config).
    import tensorflow as tf
    import keras
    from tf_twobranch.losses import common
    from tf_twobranch.systems.two_branch import losses
    keras.utils.set_random_seed(0)
    model = _make_variant_model("package")
    model.compile(optimizer=keras.optimizers.Adam(1e-4), jit_compile=False)
    batch = _paper_batch(tf)
    cfg = model.config
    fn = lambda f: tf.function(f, jit_compile=jit_compile)  # noqa: E731

    @fn
    def forward():
        return model.objective(batch, training=True)["loss"]

    @fn
    def forward_backward():
        with tf.GradientTape() as tape:
            loss = model.objective(batch, training=True)["loss"]
        return tape.gradient(loss, model.trainable_variables)

    @fn
    def forward_backward_static():
        with tf.GradientTape() as tape:
            out = model(batch, training=True)
            loss = static_shape_ranking_loss(out["image_embedding"], out["text_embedding"],
                                             batch["labels"], **cfg.loss_kwargs())
        return tape.gradient(loss, model.trainable_variables)

    grads = [tf.identity(g) for g in tf.function(forward_backward.python_function)()]
    model.optimizer.build(model.trainable_variables)

    # Every matmul the FLOP count includes, with the step's shapes and nothing else.
    mats = {name: tf.random.stateless_normal(shape, seed=[i, 0]) for i, (name, shape) in
            enumerate({"xi": (NUM_IMAGES, 4096), "xt": (NUM_TEXTS, 6000),
                       "wi1": (4096, 2048), "wt1": (6000, 2048), "w2": (2048, 512),
                       "hi": (NUM_IMAGES, 2048), "ht": (NUM_TEXTS, 2048),
                       "ei": (NUM_IMAGES, 512), "et": (NUM_TEXTS, 512),
                       "dt": (NUM_TEXTS, NUM_IMAGES), "dtt": (NUM_TEXTS, NUM_TEXTS)}.items())}

    @fn
    def matmul_equivalent():
        m_ = mats
        outs = [tf.matmul(m_["xi"], m_["wi1"]), tf.matmul(m_["xt"], m_["wt1"]),      # fwd fc1
                tf.matmul(m_["hi"], m_["w2"]), tf.matmul(m_["ht"], m_["w2"]),        # fwd fc2
                tf.matmul(m_["xi"], m_["hi"], transpose_a=True),                      # dW fc1
                tf.matmul(m_["xt"], m_["ht"], transpose_a=True),
                tf.matmul(m_["hi"], m_["ei"], transpose_a=True),                      # dW fc2
                tf.matmul(m_["ht"], m_["et"], transpose_a=True),
                tf.matmul(m_["ei"], m_["w2"], transpose_b=True),                      # dX fc2
                tf.matmul(m_["et"], m_["w2"], transpose_b=True),
                tf.matmul(m_["et"], m_["ei"], transpose_b=True),                      # distances
                tf.matmul(m_["dt"], m_["ei"]), tf.matmul(m_["dt"], m_["et"], transpose_a=True),
                tf.matmul(m_["et"], m_["et"], transpose_b=True),
                tf.matmul(m_["dtt"], m_["et"]), tf.matmul(m_["dtt"], m_["et"], transpose_a=True)]
        # reduce_max: XLA could algebraically shortcut a sum of a matmul.
        return tf.add_n([tf.reduce_max(o) for o in outs])

    @fn
    def optimizer_apply():
        model.optimizer.apply(grads, model.trainable_variables)

    @fn
    def towers_forward_backward():
        with tf.GradientTape() as tape:
            out = model(batch, training=True)
            loss = tf.reduce_sum(out["image_embedding"]) + tf.reduce_sum(out["text_embedding"])
        return tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(1)
    unit = lambda n: tf.Variable(tf.math.l2_normalize(  # noqa: E731
        rng.standard_normal((n, cfg.embed_dim), np.float32), axis=1))
    img_e, txt_e = unit(NUM_IMAGES), unit(NUM_TEXTS)

    @fn
    def loss_forward_backward():
        with tf.GradientTape() as tape:
            loss = losses.bidirectional_ranking_loss(img_e, txt_e, batch["labels"],
                                                     **cfg.loss_kwargs())
        return tape.gradient(loss, [img_e, txt_e])

    @fn
    def loss_forward_backward_ids():
        with tf.GradientTape() as tape:
            loss = _loss_neighbours_from_ids(tf, losses, img_e, txt_e, batch["labels"], cfg)
        return tape.gradient(loss, [img_e, txt_e])

    @fn
    def loss_forward_backward_static():
        with tf.GradientTape() as tape:
            loss = static_shape_ranking_loss(img_e, txt_e, batch["labels"], **cfg.loss_kwargs())
        return tape.gradient(loss, [img_e, txt_e])

    @fn
    def label_matmul():
        lf = tf.cast(batch["labels"], tf.float32)
        return tf.reduce_any(tf.matmul(lf, lf, transpose_b=True) > 0)

    @fn
    def top_k_only():
        d = common.pairwise_distance(txt_e, img_e)
        d2 = common.pairwise_distance(txt_e, txt_e)
        return (tf.reduce_sum(tf.math.top_k(d, 10).values)
                + tf.reduce_sum(tf.math.top_k(d2, 10).values))

    parts = [("matmuls of the step only (80 GFLOP)", matmul_equivalent),
             ("forward (towers + loss)", forward),
             ("forward + backward (no optimizer)", forward_backward),
             ("  same, static-shape loss (candidate)", forward_backward_static),
             ("Adam apply (22.7M params)", optimizer_apply),
             ("towers fwd+bwd, trivial loss", towers_forward_backward),
             ("loss fwd+bwd on fixed embeddings", loss_forward_backward),
             ("  same, neighbours from ids", loss_forward_backward_ids),
             ("  same, static-shape loss", loss_forward_backward_static),
             ("  label matmul 1000x500x1000 only", label_matmul),
             ("  distances + top_k only", top_k_only)]
    out = {}
    for name, f in parts:
        try:
            r = common.time_repeats(lambda: tf.nest.map_structure(lambda t: t.numpy() if hasattr(
                t, "numpy") else t, f()), repeats=repeats, warmup=2)
            out[name] = r["median"]
        except Exception as e:  # XLA compile failures are a finding, not a crash
            out[name] = f"fails: {type(e).__name__}"
    out["matmul_gflops_same_process"] = _quick_matmul_gflops(tf)
    return out


# --- evaluation (subprocess) -------------------------------------------------------

def _random_embeddings(num_images: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    num_captions = num_images * CAPTIONS_PER_IMAGE
    images = rng.standard_normal((num_images, EVAL_DIM), np.float32)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    # Captions near their image, so ranks are not all random.
    caption_image = np.repeat(np.arange(num_images, dtype=np.int32), CAPTIONS_PER_IMAGE)
    texts = images[caption_image] + 6.0 * rng.standard_normal(
        (num_captions, EVAL_DIM), np.float32) / np.sqrt(EVAL_DIM)
    texts /= np.linalg.norm(texts, axis=1, keepdims=True)
    return images.astype(np.float32), texts.astype(np.float32), caption_image


def _eval_setup(num_images: int, chunk_size: int):
    _quiet_tf()
    # Imported here, in the measuring child, so that its cost (TensorFlow's included) belongs
    # to the baseline of `common.measure_peak_memory`, not to the measured calls.
    from tf_twobranch.evaluation import retrieval
    return (retrieval.retrieval_metrics, *_random_embeddings(num_images), chunk_size)


def _eval_run(state):
    retrieval_metrics, images, texts, caption_image, chunk_size = state
    return retrieval_metrics(images, texts, caption_image, chunk_size=chunk_size)


def _eval_time_child(image_counts, chunk_size, repeats) -> list:
    rows = []
    for n in image_counts:
        state = _eval_setup(n, chunk_size)
        r = common.time_repeats(lambda: _eval_run(state), repeats=repeats, warmup=1)
        rows.append({"images": n, "captions": n * CAPTIONS_PER_IMAGE,
                     "seconds_median": r["median"], "seconds_all": r["all"],
                     "metrics": _eval_run(state)})
    return rows


def measure_evaluation(num_images: int, chunk_size: int = 2048, repeats: int = 3) -> dict:
    """Time and peak memory of `retrieval_metrics` at num_images x 5·num_images (512-d).

    One fresh subprocess: `repeats` calls after a cold one (tracing / XLA
    compile); peak RSS increase over the baseline after imports and inputs
    (`common.measure_peak_memory`). Inputs are random unit vectors, captions
    near their image.
    """
    m = common.measure_peak_memory(_eval_setup, _eval_run, (num_images, chunk_size),
                                   repeats=1 + repeats)
    return {"images": num_images, "captions": num_images * CAPTIONS_PER_IMAGE, "dim": EVAL_DIM,
            "chunk_size": chunk_size, "input_bytes": num_images * (1 + CAPTIONS_PER_IMAGE) * EVAL_DIM * 4,
            # the module's bound: one (images x chunk) block of float32 + bool
            "chunk_bound_bytes": num_images * chunk_size * 5,
            "full_matrix_bytes": num_images * num_images * CAPTIONS_PER_IMAGE * 4,
            **{k: m[k] for k in ("method", "cold_peak_bytes", "warm_peak_bytes",
                                        "cold_seconds", "warm_seconds")},
            "metrics": m["result"], "loadavg": os.getloadavg()[0]}


def _naive_setup(num_images: int):
    _quiet_tf()
    # TensorFlow after _quiet_tf, in the measuring child (its cost is in the memory baseline).
    import tensorflow as tf
    images, texts, caption_image = _random_embeddings(num_images)
    labels = np.zeros((len(texts), num_images), bool)   # the original feeds this matrix
    labels[np.arange(len(texts)), caption_image] = True
    return tf.constant(images), tf.constant(texts), tf.constant(labels)


def _naive_run(state):
    """The original `recall_k` semantics, written naively for comparison.

    Full (captions × images) distance matrix; for each K and direction the
    K nearest are taken with top_k, turned into a dense boolean mask by
    one-hot encoding each of the K columns, and a query is a hit when the
    mask meets a positive. R@K only (the original reports no ranks).
    """
    # TensorFlow in the measuring child only (see model_config).
    import tensorflow as tf
    from tf_twobranch.losses.common import pairwise_distance
    images, texts, labels = state

    def recall(dist, lab, k):   # eager, op by op, as the TF1 graph ran it
        nearest = tf.math.top_k(-dist, k=k).indices                       # (q, k)
        masks = tf.one_hot(tf.transpose(nearest), tf.shape(lab)[1], on_value=True,
                           off_value=False, dtype=tf.bool)                # (k, q, g)
        hit = tf.logical_and(tf.reduce_any(masks, axis=0), lab)
        return tf.reduce_mean(tf.reduce_max(tf.cast(hit, tf.float32), axis=1))

    dist = pairwise_distance(texts, images)
    out = {}
    for k in (1, 5, 10):
        out[f"i2t_r{k}"] = 100 * float(recall(tf.transpose(dist), tf.transpose(labels), k))
    for k in (1, 5, 10):
        out[f"t2i_r{k}"] = 100 * float(recall(dist, labels, k))
    return out


# --- orchestration ----------------------------------------------------------------

def run_training(args, matmul_best, report, lines):
    flops = step_flops()
    report["train_flops"] = flops
    report["train_flop_formula"] = FLOP_FORMULA
    configs = [
        # (label, jit, input, variant, inter_op)
        ("package, fixed batch, jit=False", False, "fixed", "package", None),
        ("package, fixed batch, jit=True", True, "fixed", "package", None),
        ("package, tf.data pipeline, jit=False", False, "tfdata", "package", None),
        ("package, fixed, jit=False, inter_op=1", False, "fixed", "package", 1),
        ("package + XLA Adam only, fixed, jit=False", False, "fixed", "xla_adam", None),
        ("package + XLA Adam only, tf.data, jit=False", False, "tfdata", "xla_adam", None),
        ("static-shape loss, fixed, jit=False", False, "fixed", "static_shape_loss", None),
        ("static-shape loss, fixed, jit=True", True, "fixed", "static_shape_loss", None),
        ("towers only + trivial loss, jit=False", False, "fixed", "dense_only", None),
        ("towers only + trivial loss, jit=True", True, "fixed", "dense_only", None),
    ]
    if args.quick:
        configs = configs[:2] + configs[5:6]
    rows, results, failures = [], [], []
    for label, jit, input_path, variant, inter_op in configs:
        print(f"  training step: {label} ...", file=sys.stderr, flush=True)
        r = common.run_in_subprocess(_train_child, jit, input_path, variant, args.train_steps,
                                     args.train_warmup, inter_op)
        if "error" in r:
            r.update(label=label, jit_compile=jit, input=input_path, variant=variant,
                     inter_op_threads=inter_op)
            results.append(r)
            rows.append([label, "fails", "", "", "", "", "", "", ""])
            failures.append(f"  {label}: {r['error'][:300]}")
            continue
        s = r["step_seconds_median"]
        counted = flops["total"] if variant != "dense_only" else (
            flops["dense_forward"] + flops["dense_backward"])
        gflops = counted / s / 1e9
        r.update(label=label, jit_compile=jit, input=input_path, variant=variant,
                 inter_op_threads=inter_op, gflops=gflops, pairs_per_second=NUM_TEXTS / s,
                 fraction_of_matmul=gflops / matmul_best,
                 fraction_of_same_process_matmul=gflops / r["matmul_gflops_same_process"])
        results.append(r)
        rows.append([label, s, r["step_seconds_min"], NUM_TEXTS / s, gflops,
                     f"{100 * r['fraction_of_matmul']:.1f}%",
                     f"{100 * r['fraction_of_same_process_matmul']:.1f}%",
                     r["matmul_gflops_same_process"], r["warmup_seconds"]])
    report["train"] = results
    lines.append(common.format_table(
        ["variant", "s/step", "min s", "pairs/s", "GFLOP/s", "of matmul", "of same-proc mm",
         "same-proc 2048² mm GFLOP/s", "warm-up s"], rows,
        title=f"(a) Training step, paper size (500 images x 2 sentences; "
              f"{flops['total'] / 1e9:.1f} GFLOP/step counted), median of "
              f"{args.train_steps} steps"))
    lines.extend(failures)
    lines.append("FLOP count: " + FLOP_FORMULA)
    lines.append(f"  dense forward {flops['dense_forward'] / 1e9:.2f} + dense backward "
                 f"{flops['dense_backward'] / 1e9:.2f} + distances {flops['distance'] / 1e9:.2f}"
                 f" = {flops['total'] / 1e9:.2f} GFLOP (label matmul, not counted: "
                 f"{flops['label_matmul_not_counted'] / 1e9:.2f} GFLOP)")
    lines.append(f"Target: >= {100 * TARGET_FRACTION:.0f}% of the matmul throughput "
                 f"(original TF1: ~82%, 0.41 s/step on the reference machine). "
                 "'of matmul' uses the best figure of section 1; 'of same-proc mm' a 2048² "
                 "matmul measured in the same subprocess, interleaved with the timed steps (robust to "
                 "load from other processes on a shared machine).")
    if not args.quick:
        print("  training step breakdown ...", file=sys.stderr, flush=True)
        rows = []
        bd = {}
        for jit in (False, True):
            bd[jit] = common.run_in_subprocess(_breakdown_child, jit, 5)
        report["train_breakdown"] = {f"jit_compile={k}": v for k, v in bd.items()}
        for name in bd[False]:
            if name == "matmul_gflops_same_process":
                continue
            rows.append([name] + [v * 1000 if isinstance(v, float) else v
                                  for v in (bd[False][name], bd[True][name])])
        rows.append(["(same-process matmul GFLOP/s)", bd[False]["matmul_gflops_same_process"],
                     bd[True]["matmul_gflops_same_process"]])
        lines.append("")
        lines.append(common.format_table(
            ["part (tf.function, median of 5)", "ms, jit=False", "ms, jit=True"], rows,
            title="(a') Where the training step's time goes"))


def run_evaluation(args, report, lines):
    chunk = 2048
    sizes = [1000, 2500, 5000] + ([] if args.quick else [10000])
    print("  evaluation timing ...", file=sys.stderr, flush=True)
    timing = common.run_in_subprocess(_eval_time_child, sizes, chunk, 3)
    print("  evaluation memory ...", file=sys.stderr, flush=True)
    memory = {}
    for c in ([2048] if args.quick else [1024, 2048, 4096]):
        memory[c] = common.measure_peak_memory(_eval_setup, _eval_run, (5000, c), repeats=4)
    mem_rows = []
    for c, m in memory.items():
        mem_rows.append([c, common.fmt_bytes(m["cold_peak_bytes"]), common.fmt_bytes(m["warm_peak_bytes"]),
                         m["cold_seconds"], m["warm_seconds"],
                         common.fmt_bytes(5000 * c * 5), m["method"]])
    base = next(r for r in timing if r["images"] == 5000)
    rows = []
    for r in timing:
        pairs = r["images"] * r["captions"]
        rows.append([f"{r['images']:,} x {r['captions']:,}", r["seconds_median"],
                     r["seconds_median"] / pairs * 1e9,
                     r["seconds_median"] / base["seconds_median"],
                     pairs / (5000 * 25000)])
    m5 = base["metrics"]
    report["eval_timing"] = timing
    report["eval_memory"] = {str(k): v for k, v in memory.items()}
    naive = None
    if not args.skip_naive:
        print(f"  naive recall_k at {args.naive_images} images ...", file=sys.stderr, flush=True)
        naive = common.measure_peak_memory(_naive_setup, _naive_run, (args.naive_images,),
                                           repeats=1)
        report["naive_recall_k"] = {"images": args.naive_images, **naive}
    lines.append(common.format_table(
        ["images x captions (512-d)", "s (median of 3)", "ns / pair", "time / 5K time",
         "pairs / 5K pairs"], rows,
        title=f"(b) Evaluation: retrieval_metrics (both directions, R@1/5/10, medr, meanr), "
              f"chunk {chunk}"))
    lines.append("  5K metrics (random embeddings): " + ", ".join(
        f"{k}={v:.2f}" for k, v in m5.items()))
    lines.append("")
    lines.append(common.format_table(
        ["chunk", "peak +RSS (cold)", "peak +RSS (warm)", "cold s", "warm s (min of 3)",
         "5000*chunk*5 B", "method"], mem_rows,
        title="(b') Peak memory at 5K x 25K over the subprocess baseline (after imports and "
              "inputs); cold = first call incl. tracing/XLA compile"))
    five_k_mem = memory.get(2048, next(iter(memory.values())))
    ok_t = base["seconds_median"] <= TARGET_EVAL_SECONDS
    ok_m = max(five_k_mem["cold_peak_bytes"], five_k_mem["warm_peak_bytes"]) <= TARGET_EVAL_BYTES
    lines.append(f"Target at 5K: <= {TARGET_EVAL_SECONDS} s ({'met' if ok_t else 'NOT met'}: "
                 f"{base['seconds_median']:.3f} s), <= 1 GB peak ({'met' if ok_m else 'NOT met'}:"
                 f" {common.fmt_bytes(max(five_k_mem['cold_peak_bytes'], five_k_mem['warm_peak_bytes']))})")
    if naive is not None:
        n = args.naive_images
        scale = (5000 * 25000) / (n * n * CAPTIONS_PER_IMAGE)
        lines.append("")
        lines.append(common.format_table(
            ["implementation", "scale", "s", "peak +RSS", "s at 5K (extrapolated)"],
            [["naive recall_k (full matrix + top_k + one-hot)", f"{n:,} x {n * 5:,}",
              naive["cold_seconds"], common.fmt_bytes(naive["cold_peak_bytes"]),
              naive["cold_seconds"] * scale],
             ["retrieval_metrics (chunked, XLA)", "5,000 x 25,000", base["seconds_median"],
              common.fmt_bytes(five_k_mem["warm_peak_bytes"]), base["seconds_median"]]],
            title="(b'') Comparison with the original recall_k semantics (R@K only, 1 run)"))
        lines.append("  naive R@K: " + ", ".join(f"{k}={v:.2f}" for k, v in naive["result"].items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_json", default="benchmarks/results/embedding.json")
    parser.add_argument("--quick", action="store_true", help="fewer variants and sizes")
    parser.add_argument("--train_steps", type=int, default=10)
    parser.add_argument("--train_warmup", type=int, default=3)
    parser.add_argument("--skip_train", action="store_true")
    parser.add_argument("--skip_eval", action="store_true")
    parser.add_argument("--skip_naive", action="store_true")
    parser.add_argument("--naive_images", type=int, default=5000)
    args = parser.parse_args(argv)

    report, lines, started = common.start_report()

    print("  matmul throughput ...", file=sys.stderr, flush=True)
    mm = common.measure_matmul_gflops()
    report["matmul"] = mm
    lines.append(common.format_table(
        ["m x k x n", "A transposed", "GFLOP/s (median)", "GFLOP/s (max)"],
        [[f"{r['m']}x{r['k']}x{r['n']}", r["transpose_a"], r["gflops_median"], r["gflops_max"]]
         for r in mm["shapes"]],
        title="1. float32 tf.matmul throughput (warm-up excluded, median of 5 blocks >= 0.3 s)"))
    lines.append(f"Best sustained: {mm['best_gflops']:.1f} GFLOP/s ({mm['best_shape']})")
    lines.append("")

    if not args.skip_train:
        run_training(args, mm["best_gflops"], report, lines)
        lines.append("")
    if not args.skip_eval:
        run_evaluation(args, report, lines)
    common.finish_report(report, lines, started, args.out_json)


if __name__ == "__main__":
    # Subprocess targets must be importable by name, not as __main__.
    from benchmarks import bench_embedding
    bench_embedding.main()
