/* The slot side of a native prefill walk's step plan (gdn_walk.c, ssd_walk.c): chunk_row [C], dest [C] (a
 * checkpoint slot or -1), end_pos [C] (the position a chunk's end state stands at); rows: slots [B] (the running slot,
 * -1 for a padding row), last_chunk [B]. One place for the range check made before anything is written and for the
 * provenance written after the states (DESIGN: a checkpoint slot records the position its state was taken at). */
#ifndef RECAP_STEP_SLOTS_H
#define RECAP_STEP_SLOTS_H

#include <stdint.h>

/* 0, or -1 when a running or checkpoint slot lies outside the cache's num_slots (-1 itself: none). */
static inline int check_step_slots(int64_t num_chunks, const int64_t *dest, int64_t num_rows, const int64_t *slots,
                                   int64_t num_slots) {
    for (int64_t r = 0; r < num_rows; r++)
        if (slots[r] < -1 || slots[r] >= num_slots) return -1;
    for (int64_t c = 0; c < num_chunks; c++)
        if (dest[c] < -1 || dest[c] >= num_slots) return -1;
    return 0;
}

/* slot_positions[d] = the position of the state now in slot d, for every checkpoint and running slot the step wrote
 * (a padding row's chunks write none). */
static inline void record_step_positions(int64_t *slot_positions, int64_t num_chunks, const int64_t *chunk_row,
                                         const int64_t *dest, const int64_t *end_pos, int64_t num_rows,
                                         const int64_t *slots, const int64_t *last_chunk) {
    for (int64_t c = 0; c < num_chunks; c++)
        if (dest[c] >= 0 && slots[chunk_row[c]] >= 0) slot_positions[dest[c]] = end_pos[c];
    for (int64_t r = 0; r < num_rows; r++)
        if (slots[r] >= 0) slot_positions[slots[r]] = end_pos[last_chunk[r]];
}

#endif
