//! Network-namespace testbed (in progress).
