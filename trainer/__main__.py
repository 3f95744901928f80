"""python -m trainer: flags -> TrainConfig -> train(). User errors exit 2 with one sentence, a
checkpoint that cannot be written exits 1 with one."""
import sys

from .config import CheckpointError, UsageError, main_usage_error, parse_args


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        from .train import train  # heavy imports only once the flags are known to be good
        return train(cfg)
    except UsageError as e:
        return main_usage_error(e)
    except CheckpointError as e:  # the run cannot go on without its checkpoints: one sentence, not a thread's traceback
        sys.stderr.write(f"trainer: error: {e}\n")  # one write: ranks sharing a stderr do not cut into it
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
