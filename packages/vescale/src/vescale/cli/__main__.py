"""``python -m vescale.cli``: the same as the ``vescale`` console script."""

from vescale.cli import main

main()
