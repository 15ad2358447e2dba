"""The records of the toy algorithm and optimizer of tests/test_registries.py, without jax: their
names and keys, and where each implementation lives. A command run from a wrapper registers
these before the command imports jax (as an outside package would), and the command imports the
implementation when it builds the run."""

from logra_jax import config as config_lib

TOY_PG = config_lib.Choice("toy_pg", rules={"toy_baseline": config_lib.FINITE},
                           implementation="test_registries:TOY_PG")
TOY_SGD = config_lib.OptimizerChoice("toy_sgd", rules={"learning_rate": config_lib.NONNEGATIVE},
                                     implementation="test_registries:TOY_SGD")

CONFIG_FILE = """import ml_collections

from configs import tiny


def get_config():
    c = tiny.get_config()
    c.rl.algorithm = "toy_pg"
    c.rl.toy_baseline = 0.0
    c.optimizer.toy_sgd = ml_collections.ConfigDict(dict(learning_rate=1e-2))
    return c
"""
