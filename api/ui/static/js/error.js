// The error page (404 and the like) needs nothing beyond the shared header.
import "./common.js";
