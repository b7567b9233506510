// Programmatic dependent launch (sm_90): the two griddepcontrol actions. Both are no-ops in a grid that was not
// launched with the programmatic-stream-serialization attribute (LaunchConfig::programmatic on the host).
#pragma once

namespace flashmla {

// Lets the next grid of the stream, if it was launched programmatically, start once every CTA of this grid has
// executed this (or exited). Says nothing about this grid's memory operations.
__device__ __forceinline__ void grid_dep_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Waits until the grids this one depends on have completed and their memory operations are visible to it.
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace flashmla
