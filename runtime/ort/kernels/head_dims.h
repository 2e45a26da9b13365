// The head sizes the PagedAttention kernel is instantiated for, listed once: OMF_HEAD_DIMS(X) expands X(d) per size,
// for the op's check and error (custom_op.cpp kHeadDims) and the kernel's dispatch (paged_attention_impl.h attend).
// contract/kernel_abi.py HEAD_DIMS is the same list (the lowering keeps plain ops for any other); the library reports
// it (omforge_kernels_info's head_dims) and tests/test_kernel_abi.py checks both against each other.
#pragma once

#define OMF_HEAD_DIMS(X) X(16) X(32) X(64) X(96) X(128) X(256)
