from tf_twobranch.models.dual_path import (DualPathConfig, DualPathModel, build_dual_path_model,  # noqa: F401
                                           build_image_cnn, build_text_cnn, load_dual_path_model)
