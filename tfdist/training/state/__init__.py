"""tfdist.training.state: what persists beyond a step and what leaves the
run: checkpoints and their file names, the Keras callbacks' state saved with
them, the user's callbacks and their files, and the SavedModel export.

Modules:
  checkpointing     checkpoints of the whole training state: where they go,
                    restore, save (`CheckpointKeeper`).
  checkpoint_paths  the names of tfdist's checkpoint files, read without
                    TensorFlow.
  callback_state    Keras callbacks' own state, saved with every checkpoint
                    and restored on resume.
  keras_callbacks   the user's Keras callbacks on every task: refused at
                    start, or kept with their files on the chief.
  export            SavedModel export with a serving signature, its
                    contract, and its folder.

Nothing is imported here: import the module you use
(`from tfdist.training.state import checkpointing`).
"""
