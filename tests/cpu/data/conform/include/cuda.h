/* Stand-in for the CUDA driver API header in conform's tests: only what they use. */
#ifndef P3_TEST_STAND_IN_CUDA_H
#define P3_TEST_STAND_IN_CUDA_H
typedef unsigned long long CUdeviceptr;
#endif
