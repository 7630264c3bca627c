/* umbp.pool._native's one translation unit: every file of this folder, included in turn (module.c says
 * which holds what).
 *
 * Why one unit: the index's hot operations call small helpers of other files (a row's slot, a key's
 * digest, the allocator's run bookkeeping); compiled one file at a time those calls could not be inlined,
 * and reserve / lookup / pin / remove ran 2-5% slower on a 2-core VM than when the extension was one file.
 * The files still compile on their own (the C checks in .ci/run build them that way too).
 */
#include "psum.c"
#include "copy.c"
#include "frames.c"
#include "headers.c"
#include "index_table.c"
#include "index_ops.c"
#include "page_runs.c"
#include "page_runs_index.c"
#include "module.c"
