/* The fused layers' dense bf16 products on AMX (Intel's tile multiply units: Sapphire Rapids and newer Xeons),
 * built where the CPU lists amx_tile and amx_bf16 (cpu_qgemm.py adds -mamx-tile -mamx-bf16) and used where the
 * kernel grants this process the tile state (amx_enable).
 *
 * Why: the AVX-512 tiles of cpu_layers.c compute every row of a step on its own, so a verify step of 16 rows cost
 * about 16 one-row steps' multiply-adds there, where PyTorch's AMX GEMMs stream the weights once for all rows. A
 * tile multiply takes 16 weight rows x 32 inputs and up to 16 activation rows at once: one-row steps stream the
 * weights as fast as before, and a tree of 16 nodes costs about what one token does.
 *
 * The layout: the weights stay as they are (row-major [n, k] bf16: a block of 16 outputs x 32 inputs is an A tile
 * read with stride k * 2 bytes); the activation rows are the B tile, packed per product into AMX's pair layout
 * (amx_pack_chunk: [row group of 16][chunk of 32 inputs][16 input pairs][16 rows][2]), rounded to bf16 (the
 * layers' bf16 inputs are bf16 values already). C[o][m] = sum over the chunks, in order, of the tile multiply's
 * pair products: each (row, output) one fixed sequence whatever the other rows (absent rows are zero columns), so
 * a row's result does not depend on its step, as in cpu_layers.c. Inputs past k are zero in both tiles (the last
 * chunk's weights are copied into a zero-padded block); outputs past the last whole 16 stay with cpu_layers.c's
 * tiles, for every step alike.
 */
#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int granted = -1;  /* -1: not asked yet */

#ifndef AHEAD_CHUNKS
#define AHEAD_CHUNKS 8
#endif

/* 1 where this process may use the tiles (asked of the kernel once; the answer holds for the process), else 0. */
int amx_enable(void) {
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

int amx_on(void) { return granted == 1; }

/* Tiles 0-5 (C: 16 outputs x 16 rows fp32, one per row group of a pass), 6 (A: 16 outputs x 32 bf16), 7 (B: 16
 * pairs x 16 rows x 2 bf16), for the calling thread (the tile state is per thread). */
void amx_begin(void) {
    /* static: GCC treats the intrinsic's operand as unread, so a configuration built on the stack was dropped */
    static const TileConfig config = {
        .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&config);
}

void amx_end(void) { _tile_release(); }

/* Row group g (rows 16g .. 16g + 16 of x, those past t zero) and input chunk c (32 inputs, those past k zero) of
 * x [t, ldx] fp32 into xv: 16 x 16 pairs of bf16. */
void amx_pack_chunk(const float *x, int ldx, int t, int k, int g, int c, uint32_t *xv) {
    const int chunks = (k + 31) / 32;
    uint16_t *out = (uint16_t *)(xv + ((size_t)g * chunks + c) * 256);
    for (int p = 0; p < 16; p++)
        for (int m = 0; m < 16; m++)
            for (int h = 0; h < 2; h++) {
                const int r = 16 * g + m, i = 32 * c + 2 * p + h;
                out[(p * 16 + m) * 2 + h] = r < t && i < k ? f32_to_bf16(x[(size_t)r * ldx + i]) : 0;
            }
}

#define AMX_GROUP(G)                                                            \
    case G:                                                                     \
        _tile_loadd(7, xv + ((size_t)(G) * chunks + c) * 256, 64);              \
        _tile_dpbf16ps(G, 6, 7);

/* out [groups][16 outputs][16 rows] fp32 = outputs o0 .. o0 + 16 of w [n, k] bf16 times the packed row groups
 * 0 .. groups (at most AMX_GROUPS: one C tile each, sharing each chunk's weight tile). */
void amx_block(const uint16_t *w, int k, int o0, const uint32_t *xv, int groups, float *out) {
    const int chunks = (k + 31) / 32, whole = k / 32;
    uint16_t tail[16 * 32];
    if (whole < chunks) {  /* the last chunk's weights, zero-padded to 32 inputs */
        memset(tail, 0, sizeof tail);
        for (int j = 0; j < 16; j++)
            memcpy(tail + j * 32, w + (size_t)(o0 + j) * k + 32 * whole, sizeof(uint16_t) * (size_t)(k - 32 * whole));
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int c = 0; c < chunks; c++) {
        /* the weight lines AHEAD chunks on (past the block's last chunk: the next block's first, which this thread
         * takes next under the static schedule): 16 rows of 64 bytes a chunk, where the prefetchers lagged */
        const int ahead = c + AHEAD_CHUNKS, next = ahead < chunks ? o0 : o0 + 16, at = ahead < chunks ? ahead : ahead - chunks;
        for (int j = 0; j < 16; j++) _mm_prefetch((const char *)(w + (size_t)(next + j) * k + 32 * at), _MM_HINT_T0);
        if (c < whole)
            _tile_loadd(6, w + (size_t)o0 * k + 32 * c, (long)k * 2);
        else
            _tile_loadd(6, tail, 64);
        switch (groups - 1) {  /* falls through: group groups - 1 down to 0 */
            AMX_GROUP(5)
            AMX_GROUP(4)
            AMX_GROUP(3)
            AMX_GROUP(2)
            AMX_GROUP(1)
            AMX_GROUP(0)
        }
    }
    switch (groups) {
        case 6: _tile_stored(5, out + 5 * 256, 64);  /* fall through */
        case 5: _tile_stored(4, out + 4 * 256, 64);  /* fall through */
        case 4: _tile_stored(3, out + 3 * 256, 64);  /* fall through */
        case 3: _tile_stored(2, out + 2 * 256, 64);  /* fall through */
        case 2: _tile_stored(1, out + 256, 64);      /* fall through */
        case 1: _tile_stored(0, out, 64);
    }
}
#else
int amx_enable(void) { return 0; }
int amx_on(void) { return 0; }
void amx_begin(void) {}
void amx_end(void) {}
void amx_pack_chunk(const float *x, int ldx, int t, int k, int g, int c, uint32_t *xv) {
    (void)x, (void)ldx, (void)t, (void)k, (void)g, (void)c, (void)xv;
}
void amx_block(const uint16_t *w, int k, int o0, const uint32_t *xv, int groups, float *out) {
    (void)w, (void)k, (void)o0, (void)xv, (void)groups, (void)out;
}
#endif
