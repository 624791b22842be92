# Writes OUT (a header defining FLASHMIX_GIT_COMMIT: the short hash of SRC's
# HEAD, "-dirty" when tracked files differ from it) at build time, so a build
# directory configured before later commits still stamps the commit its
# binaries are built from. The file is rewritten only when the text changes.
# Usage: cmake -DSRC=<source dir> -DOUT=<header> -P git_commit.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit "unknown")
elseif(dirty)
  set(commit "${commit}-dirty")
endif()
file(WRITE "${OUT}.tmp" "#define FLASHMIX_GIT_COMMIT \"${commit}\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
