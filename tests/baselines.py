"""Chance levels for the end-to-end tests: a trained model must beat random embeddings."""
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
