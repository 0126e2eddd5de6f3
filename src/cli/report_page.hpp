// The HTML page of `epx report` (report/page.html), with /*EPX_PLOTLY*/ and /*EPX_DATA*/ where the
// plotting library and the runs' JSON go.
#pragma once

namespace epx::cli {

const char* report_page_template();

}  // namespace epx::cli
