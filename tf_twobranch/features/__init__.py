"""Image and text features: backbones, the embedded data's stand-ins for pretrained parts, caches."""

# The seed of every stand-in for a pretrained or published input on the embedded data: the scene
# CNN standing for ImageNet weights, the PPMI-SVD vectors standing for GloVe / word2vec, the fitted
# text features and proposals. Fixed whatever a run's --seed, as the files they stand for are one
# artefact on real data; --seed varies only the system's own initialisation, sampling and dropout,
# so the spread over seeds is the system's. Measured (BUILD_NOTES "The leaderboard"): the two-branch
# full model at --seed=1 scored rsum 105.4 on seed 1's own stand-ins and 143.0 on these (seed 0:
# 143.7), while CCA moved 118.3 -> 109.2: the stand-ins, not the training, made the seed spread.
FEATURE_SEED = 0

# Epochs of the scene CNN (the embedded data's stand-in for an ImageNet backbone) a system trains on
# the training images when --image_backbone=scene_cnn: every feature spec's and recipe's default.
SCENE_CNN_EPOCHS = 12
