"""Stand-alone tools around the recipes, apart from the runtime they import (`accelerate_recipes`).

- `accelerate-recipes-doctor` (recipe_tools.doctor): multi-node preflight, run on every node.
- `accelerate-recipes-hostfile` (recipe_tools.multinode): `accelerate launch` on every node of a
  hostfile over ssh.
- `accelerate-recipes-topo` (recipe_tools.topology): GPU groups from `nvidia-smi topo -m` and the
  best GPUs to use.
"""
