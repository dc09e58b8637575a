"""The paper's experiments as ``srot-fast`` sub-commands (one module per experiment).

Each module defines ``NAME`` (the sub-command), ``HELP`` (one line), ``add_arguments(parser)`` (its own
options; the common ones -- ``--out --quick --seed --backend --device --threads --no-progress`` -- are
added by :func:`srot_fast.experiments._common.add_common`; an optional ``DEFAULT_DEVICE`` sets the
``--device`` default) and ``run(args) -> dict`` which writes PNG figures, ``metrics.json`` and ``metrics.md``
into ``args.out`` and returns the metrics (with a "claims" list whose entries have "passed").
"""
MODULES = ("demo", "flow2d", "flow_images", "monge", "label_prop", "gan", "cloud3d")
