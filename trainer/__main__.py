"""python -m trainer: flags -> TrainConfig -> train(). User errors exit 2 with one sentence."""
import sys

from .config import UsageError, main_usage_error, parse_args


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        from .train import train  # heavy imports only once the flags are known to be good
        return train(cfg)
    except UsageError as e:
        return main_usage_error(e)


if __name__ == "__main__":
    sys.exit(main())
