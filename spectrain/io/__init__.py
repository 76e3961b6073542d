"""Input and output that every other layer relies on, with no torch and no model in sight.

- ``errors``: the CLI's one-line error path and ``writing()`` (an OSError names the file and the fix);
- ``integrity``: sha256 manifests (``SHA256SUMS``) for checkpoints and exports, verified on load;
- ``outputs``: output directories that never destroy a user's file and never follow a link;
- ``resources``: where the shipped recipes, prompt sets, chat data and reference target live;
- ``progress``: the one progress bar of the long data commands;
- ``safe_resume``: reading a checkpoint that may come from anywhere, with nothing unpickled as objects;
- ``disk``: free space checks before a long write.
"""
