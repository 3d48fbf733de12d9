"""`python -m laco_deploy.cli` (and `torchrun -m laco_deploy.cli`): the same as the `laco-deploy` command."""

from laco_deploy.cli import main

main()
