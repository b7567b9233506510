//! CPU reference implementations: the truth every kernel is tested against.
