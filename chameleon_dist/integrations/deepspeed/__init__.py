"""DeepSpeed integration (installs the chameleon runtime into DeepSpeed engines); not built yet."""
