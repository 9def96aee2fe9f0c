"""Helpers of the honesty tests: chance levels a trained model must beat, and models whose
constant inputs give non-trivial (but collapsed) embeddings."""
import numpy as np

from tf_twobranch.evaluation import retrieval


def random_retrieval_rsum(num_images: int, caption_image, *, protocol: str = "full",
                          num_seeds: int = 20) -> float:
    """Mean + 2 std of the rsum of random embeddings on the same split and protocol.

    A model that learned nothing passes this bar about 1 time in 40; a
    collapsed one (all scores tied) scores 0.
    """
    rsums = [retrieval.random_baseline_metrics(num_images, np.asarray(caption_image),
                                               protocol=protocol, seed=s)["rsum"]
             for s in range(num_seeds)]
    return float(np.mean(rsums) + 2 * np.std(rsums))


def randomize_weights(model, seed: int = 0):
    """Random weights, biases and batch-norm statistics (variances kept positive).

    A freshly built tower has zero biases and identity batch norm, so it maps
    all-zero inputs to all-zero embeddings; with these weights constant
    inputs map to a constant but non-zero embedding.
    """
    rng = np.random.default_rng(seed)
    for v in model.weights:
        shape = tuple(v.shape)
        if v.path.endswith("variance"):
            v.assign(rng.uniform(0.5, 1.5, shape).astype(np.float32))
        else:
            v.assign(rng.normal(0.0, 0.5, shape).astype(np.float32))
    return model
