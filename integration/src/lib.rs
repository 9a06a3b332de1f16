//! Integration tests only; see tests/.
