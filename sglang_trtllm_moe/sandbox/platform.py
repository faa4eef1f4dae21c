"""The platform faking of the CPU harness: it lives with the product (`compat.fake_platform`, which `explain` and
the test-only CPU sandbox need); this name keeps the harness's imports working."""

from ..compat.fake_platform import fake_blackwell, fake_platform, platform_facts

__all__ = ["fake_blackwell", "fake_platform", "platform_facts"]
