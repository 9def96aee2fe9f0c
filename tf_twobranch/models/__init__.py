"""The contract every system's model is built on.

`base`: the configuration base class, its one saver/loader, and the contract
(builder, `objective`, `evaluate`); `evaluation_input`: what every
`evaluate` takes. The four models live in their systems' folders
(`tf_twobranch.systems.<name>.model`).
"""
